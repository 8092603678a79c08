"""ProcessGroupMpidp: a torch.distributed process group whose collectives run on mpidp's engine."""

from typing import List, Optional

import torch
import torch.distributed as dist

from ..engine.dtypes import SUPPORTED
from ..engine.messages import ReduceOp
from ..errors import MismatchError
from ..ops import allreduce_ops, express, gather_ops
from ..ops.barrier_join import barrier
from ..ops.collectives import allreduce_
from ..runtime.process_sets import global_process_set, member_of
from . import conversions as conv
from . import p2p
from .held import Held
from .naming import CallNames
from .work import Work

_SUM, _AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
_HOST_DTYPES = frozenset(SUPPORTED)


class ProcessGroupMpidp(dist.ProcessGroup):
    """A torch.distributed process group on an mpidp process set: the world's global set, or a
    set created by the group's members alone (torch creates a subgroup on its members only).

    Every collective is one (or a few) of mpidp's ops, negotiated by the set's engine: a rank
    that calls a different collective, or the same with another shape or dtype, is found out
    by the engine (an error or a stall report naming the ranks) instead of hanging silently.
    Synchronization points are torch's: each collective with every rank of the group.
    """

    def __init__(self, rank: int, size: int, process_set=None, ranks: Optional[List[int]] = None):
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs omit this form
        self._ps = process_set
        self._ranks = list(ranks) if ranks is not None else list(range(size))
        self._name = ""
        self._desc = ""
        self._done = Work.finished([])  # what a blocking call returns: torch only waits on it
        prefix = "w" if process_set is None else f"s{'.'.join(map(str, self._ranks))}"
        self._names = CallNames(prefix)
        self._held = Held(self._names.failed, process_set, f"mpidp.overlap_trial.{prefix}")

    # ---- what torch asks of a process group ----

    def _work(self, handles: List[int], finish) -> Work:
        return Work(handles, finish, on_error=self._names.failed)

    def _blocking_allreduce(self, t: torch.Tensor, name: str, op) -> None:
        try:
            # The express lane first, without the public call's layers (nothing here is traced:
            # under torch.compile dist.all_reduce becomes a functional collective, which reaches
            # the group when it runs).
            if express.allreduce(t, name, op, 1.0, 1.0, self._ps, True) is None:
                allreduce_(t, name=name, op=op, process_set=self._ps)
        except MismatchError as exc:
            self._names.failed(exc)
            raise

    def getBackendName(self) -> str:
        return "mpidp"

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def overlap_settled(self) -> bool:
        """Whether this group's async allreduces from backward passes (DDP's buckets) have a
        fixed overlap mode: `auto` across hosts times both modes over the first passes first
        (docs/torch_distributed.md). Synchronization: none."""
        return self._held.settled()

    @property
    def process_set(self):
        """The mpidp process set this group runs on (mpidp.global_process_set for the world)."""
        return global_process_set if self._ps is None else self._ps

    # ---- reductions ----

    def _allreduce_one(self, t: torch.Tensor, red, blocking: bool, hold: bool = False):
        """Submit the allreduce of `t` in place; returns (handle, finish): handle None if it ran
        at once (blocking), the call's Work if it is held (`hold`, see Held)."""
        op, pre = conv.engine_op(red)
        wire = conv.reducible(t, op, "all_reduce")
        work_t = wire if wire.is_contiguous() else wire.contiguous()

        def finish():
            if work_t is not wire:
                wire.copy_(work_t)

        name = self._names.next("allreduce", [work_t])
        if blocking and pre == 1.0 and t.device.type == "cpu":
            self._blocking_allreduce(work_t, name, op)
            finish()
            return None, finish

        def submit() -> int:
            hid = allreduce_ops.allreduce_async_(
                work_t, name=name, op=op, prescale_factor=pre, process_set=self._ps
            )
            return self._names.submitted(name, hid)

        if hold:
            return self._held.hold(name, submit, lambda _: (finish(), [t])[1]), finish
        return submit(), finish

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        if not opts.asyncOp and len(tensors) == 1:  # the blocking call's short way
            t, red = tensors[0], opts.reduceOp
            # Compared, not looked up: hashing torch's op type costs several microseconds.
            op = ReduceOp.SUM if red == _SUM else ReduceOp.AVERAGE if red == _AVG else None
            if op is not None and t.is_cpu and t.dtype in _HOST_DTYPES and t.is_contiguous():
                self._blocking_allreduce(t, self._names.next("allreduce", (t,)), op)
                return self._done
        if len(tensors) != 1:
            return self.allreduce_coalesced(tensors, opts)
        hold = opts.asyncOp and self._held.applies(tensors[0])
        hid, finish = self._allreduce_one(tensors[0], opts.reduceOp, not opts.asyncOp, hold)
        if hid is None:
            return Work.finished(tensors)
        if hold:
            return hid
        work = self._work([hid], lambda _: (finish(), tensors)[1])
        if opts.asyncOp:
            self._held.track(work, tensors[0])
        return work

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        op, pre = conv.engine_op(opts.reduceOp)
        wires = [conv.reducible(t, op, "all_reduce_coalesced") for t in tensors]
        work = [w if w.is_contiguous() else w.contiguous() for w in wires]
        name = self._names.next("allreduce_coalesced", work)
        hid = allreduce_ops.grouped_allreduce_async_(
            work, name=name, op=op, prescale_factor=pre, process_set=self._ps
        )

        def finish(_):
            for w, c in zip(wires, work):
                if w is not c:
                    w.copy_(c)
            return list(tensors)

        return self._work([self._names.submitted(name, hid)], finish)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        t = tensors[0]
        # Only the root's tensor changes, as with torch's other backends.
        target = t if self.rank() == opts.rootRank else t.clone()
        hid, finish = self._allreduce_one(target, opts.reduceOp, not opts.asyncOp)
        if hid is None:
            return Work.finished(tensors)
        return self._work([hid], lambda _: (finish(), tensors)[1])

    def _reduce_scatter_one(self, output: torch.Tensor, rows: torch.Tensor, red, kind: str):
        op, pre = conv.engine_op(red)
        rows = conv.reducible(rows, op, kind)
        out = conv.reducible(output, op, kind)
        size = self.size()
        src = (rows if rows.is_contiguous() else rows.contiguous()).reshape(size, -1)
        if pre != 1.0:
            src = src * pre
        dst = (
            out.reshape(1, -1)
            if out.is_contiguous()
            else torch.empty((1, out.numel()), dtype=out.dtype, device=out.device)
        )
        name = self._names.next(kind, [src])
        hid = gather_ops.reducescatter_into_async(src, dst, name=name, op=op, process_set=self._ps)

        def finish():
            if dst.data_ptr() != out.data_ptr():
                out.copy_(dst.reshape(out.shape))

        return self._names.submitted(name, hid), finish

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        hid, fin = self._reduce_scatter_one(output, input, opts.reduceOp, "reduce_scatter")
        return self._work([hid], lambda _: (fin(), [output])[1])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        hids, fins = [], []
        for out, parts in zip(output_tensors, input_tensors):
            rows = torch.stack([p.reshape(-1) for p in parts])
            hid, fin = self._reduce_scatter_one(out, rows, opts.reduceOp, "reduce_scatter")
            hids.append(hid)
            fins.append(fin)
        return self._work(hids, lambda _: ([f() for f in fins], list(output_tensors))[1])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        pairs = [
            self._reduce_scatter_one(o, i, opts.reduceOp, "reduce_scatter")
            for o, i in zip(outputs, inputs)
        ]
        return self._work(
            [h for h, _ in pairs], lambda _: ([f() for _, f in pairs], list(outputs))[1]
        )

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # ---- data movement ----

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        t = tensors[0]
        wire = conv.flat(t)
        name = self._names.next("broadcast", [wire])
        hid = gather_ops.broadcast_async_(wire, opts.rootRank, name=name, process_set=self._ps)
        return self._work(
            [self._names.submitted(name, hid)], lambda _: conv.filled(t, wire, tensors)
        )

    def _allgather_one(self, output: torch.Tensor, input: torch.Tensor, kind: str):
        src = conv.flat(input).reshape(1, -1)
        size = self.size()
        if output.is_contiguous() and output.numel() == size * input.numel():
            dst = conv.flat(output).reshape(size, -1)
        else:
            dst = torch.empty((size, src.shape[1]), dtype=src.dtype, device=src.device)
        name = self._names.next(kind, [src])
        hid = gather_ops.allgather_into_async(src, dst, name=name, process_set=self._ps)
        return self._names.submitted(name, hid), dst

    def _allgather_base(self, output, input, opts=None):
        hid, dst = self._allgather_one(output, input, "allgather")
        return self._work([hid], lambda _: conv.filled(output, dst, [output]))

    all_gather_single = _allgather_base

    def allgather(self, output_tensors, input_tensors, opts=None):
        jobs = [self._allgather_one(torch.empty(0), t, "allgather") for t in input_tensors]

        def finish(_):
            for outs, (_, dst) in zip(output_tensors, jobs):
                for i, o in enumerate(outs):
                    conv.copy_into(o, dst[i])
            return [o for outs in output_tensors for o in outs]

        return self._work([h for h, _ in jobs], finish)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        jobs = [self._allgather_one(o, i, "allgather") for o, i in zip(outputs, inputs)]

        def finish(_):
            for o, (_, dst) in zip(outputs, jobs):
                conv.copy_into(o, dst)
            return list(outputs)

        return self._work([h for h, _ in jobs], finish)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def _alltoall_flat(self, send: torch.Tensor, splits: List[int], kind: str):
        name = self._names.next(kind, [send], shaped=False)
        hid = gather_ops.alltoall_received_async(
            send, splits=splits, name=name, process_set=self._ps
        )
        return self._names.submitted(name, hid)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        size = self.size()
        rows = input.shape[0] if input.dim() else 1
        if not input_split_sizes:
            if rows % size:
                raise ValueError(
                    f"all_to_all_single: {rows} rows do not split evenly over "
                    f"{size} ranks; pass input_split_sizes"
                )
            input_split_sizes = [rows // size] * size
        row = input.numel() // max(rows, 1)
        send = conv.flat(input)
        scale = send.numel() // max(input.numel(), 1) if input.numel() else 1
        splits = [s * row * scale for s in input_split_sizes]
        hid = self._alltoall_flat(send, splits, "alltoall")

        def finish(results):
            received, _ = results[0]
            conv.copy_into(output, received)
            return [output]

        return self._work([hid], finish)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        flats = [conv.flat(t) for t in input_tensors]
        send = torch.cat(flats) if flats else torch.empty(0, dtype=torch.uint8)
        hid = self._alltoall_flat(send, [f.numel() for f in flats], "alltoall")

        def finish(results):
            received, counts = results[0]
            offset = 0
            for o, n in zip(output_tensors, counts.tolist()):
                conv.copy_into(o, received[offset : offset + n])
                offset += n
            return list(output_tensors)

        return self._work([hid], finish)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        send = conv.flat(input_tensors[0])
        splits = [0] * self.size()
        splits[opts.rootRank] = send.numel()
        hid = self._alltoall_flat(send, splits, "gather")

        def finish(results):
            received, counts = results[0]
            if self.rank() == opts.rootRank:
                offset = 0
                for o, n in zip(output_tensors[0], counts.tolist()):
                    conv.copy_into(o, received[offset : offset + n])
                    offset += n
            return [o for outs in output_tensors for o in outs]

        return self._work([hid], finish)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        out = output_tensors[0]
        if self.rank() == opts.rootRank:
            flats = [conv.flat(t) for t in input_tensors[0]]
            send, splits = torch.cat(flats), [f.numel() for f in flats]
        else:
            send, splits = conv.flat(out)[:0], [0] * self.size()
        hid = self._alltoall_flat(send, splits, "scatter")

        def finish(results):
            conv.copy_into(out, results[0][0])
            return [out]

        return self._work([hid], finish)

    def barrier(self, opts=None):
        barrier(self._ps)
        return Work.finished([])

    # ---- point to point ----

    def send(self, tensors, dst: int, tag: int = 0):
        return p2p.send(self._ps, tensors[0], dst, tag)

    def recv(self, tensors, src: int, tag: int = 0):
        return p2p.recv(self._ps, tensors[0], src, tag)

    def recv_anysource(self, tensors, tag: int = 0):
        return p2p.recv(self._ps, tensors[0], None, tag)

    # ---- lifetime ----

    def shutdown(self) -> None:
        """Called by destroy_process_group(): a subgroup's set stops its engine (the world's
        set stays: mpidp.torch may use it). Synchronization: the group's members."""
        if self._ps is not None and self._ps.process_set_id is not None:
            from ..runtime.process_sets import remove_process_set

            remove_process_set(self._ps)

    def abort(self) -> None:
        self.shutdown()


def member(process_set) -> tuple:
    """(state, member) of this rank in `process_set` (None: the world); see member_of."""
    return member_of(process_set, "torch.distributed")

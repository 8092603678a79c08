"""Per-step wall-time breakdown of rank 0 from a py-spy chrometrace (record --idle --threads).

    python analyze_spy.py TRACE.json STEPS [--mode mpidp|raw] [--json out.json]

py-spy's chrometrace merges consecutive samples with the same stack into B/E slices, so the time
between two consecutive events of a thread is spent in the stack open at that moment.
The window is the main thread's `timed_loop` slice (profile_step.py); everything is clipped to it
and divided by STEPS.
"""

import argparse
import collections
import json


def intervals(events):
    """tid -> list of (t0, t1, stack tuple of (name, file, line)) in time order."""
    by_tid = collections.defaultdict(list)
    for e in events:
        if e.get("ph") in ("B", "E"):
            by_tid[e["tid"]].append(e)
    out = {}
    for tid, evs in by_tid.items():
        # py-spy appends events in order; ties keep file order (E before B at one sample).
        stack, spans, prev_ts = [], [], None
        for e in evs:
            ts = e["ts"]
            if prev_ts is not None and ts > prev_ts and stack:
                spans.append((prev_ts, ts, tuple(stack)))
            prev_ts = ts
            fr = (e["name"], e["args"].get("filename", ""), e["args"].get("line"))
            if e["ph"] == "B":
                stack.append(fr)
            else:
                # pop the matching frame (the innermost with this name)
                for i in range(len(stack) - 1, -1, -1):
                    if stack[i][0] == fr[0]:
                        del stack[i:]
                        break
        out[tid] = spans
    return out


def _is(f, name):
    return f[0] == name or f[0].endswith("." + name)


def has(stack, name, file_part=None):
    return any(_is(f, name) and (file_part is None or file_part in f[1]) for f in stack)


def find(stack, name, file_part=None):
    for i, f in enumerate(stack):
        if _is(f, name) and (file_part is None or file_part in f[1]):
            return i
    return -1


def leaf_desc(stack, start):
    """A short description of the frames below index `start`: the deepest frame's name:line,
    and the first mpidp/torch frame under start."""
    leaf = stack[-1]
    return f"{leaf[0]} ({leaf[1].split('/')[-1]}:{leaf[2]})"


def classify_main(stack, mode):
    if has(stack, "_hook", "mpidp") or has(stack, "timed_hook"):
        i = find(stack, "_hook", "mpidp")
        sub = stack[i + 1][0] if i >= 0 and i + 1 < len(stack) else "(_hook itself)"
        # one level deeper for the heavy path _submit -> allreduce_async_ -> ...
        j = find(stack, "allreduce_async_", "mpidp")
        if j >= 0 and j + 1 < len(stack):
            k = j + 1
            sub = f"allreduce_async_ > {stack[k][0]}"
            leaf = stack[k][0].split(".")[-1]
            if leaf in ("_grouped_allreduce", "_submit") and k + 1 < len(stack):
                sub += f" > {stack[k + 1][0]}"
        elif find(stack, "_submit", "optimizer.py") >= 0:
            s = find(stack, "_submit", "optimizer.py")
            sub = "_submit > " + (stack[s + 1][0] if s + 1 < len(stack) else "(self)")
        return "gradient hooks (_hook and below)", sub
    if has(stack, "backward"):
        return "backward compute", ""
    if has(stack, "synchronize", "mpidp/training/optimizer.py"):
        if has(stack, "wait", "handles.py"):
            return "synchronize: waiting on handles", leaf_desc(stack, 0)
        return "synchronize: other", leaf_desc(stack, 0)
    if any("torch/optim" in f[1] for f in stack) and not has(stack, "zero_grad"):
        return "optimizer step (SGD)", ""
    if has(stack, "zero_grad"):
        return "zero_grad", ""
    if (
        has(stack, "cross_entropy")
        or has(stack, "_call_impl")
        or has(stack, "forward")
        or has(stack, "_wrapped_call_impl")
    ):
        return "forward + loss", ""
    leaf = stack[-1]
    if mode == "raw" and _is(leaf, "step") and "profile_step" in leaf[1]:
        return "raw per-tensor Allreduce + div_", f"line {leaf[2]}"
    if has(stack, "step", "mpidp/training/optimizer.py"):
        return "DistributedOptimizer.step other", leaf_desc(stack, 0)
    return "other (loop/timing)", leaf_desc(stack, 0)


def classify_engine(stack):
    if not has(stack, "_cycle", "engine.py"):
        leaf = stack[-1]
        if has(stack, "_run", "engine.py"):
            if (
                _is(leaf, "wait")
                and "threading" in leaf[1]
                or _is(leaf, "_run")
                and leaf[2] in (135, 144)
            ):
                return "idle (sleeping between cycles)", leaf_desc(stack, 0)
            return "idle loop other", leaf_desc(stack, 0)
        return "outside engine loop", leaf_desc(stack, 0)
    for fn in ("allreduce_band", "gather_objects", "bcast_object"):
        i = find(stack, fn, "mpi.py")
        if i >= 0:
            leaf = stack[-1]
            if _is(leaf, "wait") and "mpi.py" in leaf[1]:
                kind = {
                    42: "sleep backoff",
                    41: "Test (poll loop)",
                    38: "Test (spin)",
                    37: "spin perf_counter",
                    34: "Test (first)",
                }.get(leaf[2], f"line {leaf[2]}")
                return f"negotiation: {fn} waiting", kind
            return f"negotiation: {fn} other", leaf_desc(stack, 0)
    if has(stack, "execute") and any("backends" in f[1] for f in stack):
        leaf = stack[-1]
        if _is(leaf, "allreduce") and "mpi.py" in leaf[1]:
            return "data path: MPI Allreduce call", ""
        return "data path: pack/unpack/scale/other", leaf_desc(stack, 0)
    if has(stack, "_release", "engine.py"):
        return "completion (_release)", leaf_desc(stack, 0)
    i = find(stack, "_cycle", "engine.py")
    nxt = stack[i + 1] if i + 1 < len(stack) else None
    if nxt is None:
        return "bookkeeping: _cycle body", f"line {stack[-1][2]}"
    return "bookkeeping: " + nxt[0], leaf_desc(stack, 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("steps", type=int)
    ap.add_argument("--mode", default="mpidp")
    ap.add_argument("--json")
    ap.add_argument("--subs", type=int, default=6)
    args = ap.parse_args()
    ev = json.load(open(args.trace))
    spans = intervals(ev)
    main_tid = engine_tid = None
    for tid, sp in spans.items():
        if any(has(s, "timed_loop") for _, _, s in sp):
            main_tid = tid
        if any(has(s, "_run", "engine.py") for _, _, s in sp):
            engine_tid = tid
    win = [(a, b) for a, b, s in spans[main_tid] if has(s, "timed_loop")]
    w0, w1 = win[0][0], win[-1][1]
    wall = (w1 - w0) / 1e3  # ms
    n = args.steps
    res = {"window_ms": wall, "step_ms": wall / n, "threads": {}}

    def tally(tid, fn):
        cat = collections.Counter()
        sub = collections.defaultdict(collections.Counter)
        for a, b, s in spans.get(tid, []):
            a, b = max(a, w0), min(b, w1)
            if b <= a:
                continue
            c, d = fn(s)
            cat[c] += (b - a) / 1e3
            sub[c][d] += (b - a) / 1e3
        return cat, sub

    mc, ms = tally(main_tid, lambda s: classify_main(s, args.mode))
    out = {"main": (mc, ms)}
    if engine_tid is not None:
        out["engine"] = tally(engine_tid, classify_engine)
        # engine time during the main thread's backward (compute + hooks)
        bw = [
            (max(a, w0), min(b, w1))
            for a, b, s in spans[main_tid]
            if has(s, "backward") and min(b, w1) > max(a, w0)
        ]
        overlap = collections.Counter()
        bw_total = sum(b - a for a, b in bw) / 1e3
        j = 0
        esp = [(a, b, s) for a, b, s in spans[engine_tid] if b > w0 and a < w1]
        for a, b, s in esp:
            while j < len(bw) and bw[j][1] <= a:
                j += 1
            k = j
            while k < len(bw) and bw[k][0] < b:
                ov = min(b, bw[k][1]) - max(a, bw[k][0])
                if ov > 0:
                    overlap[classify_engine(s)[0]] += ov / 1e3
                k += 1
        res["engine_during_backward"] = {k: v / n for k, v in overlap.items()}
        res["backward_ms_per_step"] = bw_total / n
    print(f"window {wall:.1f} ms over {n} steps: {wall / n:.2f} ms/step (profiled run)")
    for name, (cat, sub) in out.items():
        tot = sum(cat.values())
        print(f"\n### {name} thread  (covered {tot / n:.2f} ms/step of {wall / n:.2f})")
        print("| category | ms/step | % of step |\n|---|---:|---:|")
        for c, v in cat.most_common():
            print(f"| {c} | {v / n:.2f} | {100 * v / wall:.1f} |")
        res["threads"][name] = {c: v / n for c, v in cat.items()}
        res["threads"][name + "_sub"] = {
            c: {d: x / n for d, x in sub[c].most_common(args.subs)} for c in cat
        }
        print("\nsub-breakdown (top entries):")
        for c, v in cat.most_common():
            parts = ", ".join(f"{d or '-'}: {x / n:.2f}" for d, x in sub[c].most_common(args.subs))
            print(f"- {c}: {parts}")
    if "engine_during_backward" in res:
        print(
            f"\nengine thread during main-thread backward ({res['backward_ms_per_step']:.2f} "
            f"ms/step incl. hooks):"
        )
        for c, v in sorted(res["engine_during_backward"].items(), key=lambda kv: -kv[1]):
            print(f"  {c}: {v:.2f} ms/step")
    if args.json:
        json.dump(res, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()

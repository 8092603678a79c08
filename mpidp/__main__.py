"""Command line: `python -m mpidp doctor|timeline` (also installed as the `mpidp` command)."""

import argparse
import sys


def main(argv=None) -> int:
    """Parse the command line and run the sub-command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="mpidp", description="mpidp command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser(
        "doctor",
        help="check MPI, torch and the MPIDP_* knobs; smoke-test the collectives",
        description="Check the MPI library, its thread level and CUDA awareness, NCCL/gloo, "
        "torch and the MPIDP_* knobs that are set. Under a launcher (mpiexec -n 2 "
        "python -m mpidp doctor) it also runs an allreduce, an allgather and a "
        "broadcast and checks their results. Rank 0 prints the report; the exit "
        "code is 0 only when every check passed.",
    )
    doctor.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds each smoke-test collective may take (default 60)",
    )
    check = sub.add_parser(
        "timeline",
        help="check a timeline file before opening it in Perfetto",
        description="Check that a timeline (MPIDP_TIMELINE) follows the Trace Event Format rules "
        "Perfetto and chrome://tracing rely on; a file cut short by a killed process "
        "is read as far as it goes. Exit code 1 names the first bad event.",
    )
    check.add_argument("file")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .tools.doctor import run

        return run(timeout=args.timeout)
    if args.command == "timeline":
        from .engine import timeline

        try:
            found = timeline.validate(timeline.load(args.file))
        except (OSError, ValueError) as exc:
            print(f"{args.file}: not a valid trace: {exc}", file=sys.stderr)
            return 1
        print(
            f"{args.file}: valid trace, {sum(found.values())} events "
            f"({', '.join(f'{n} {ph}' for ph, n in sorted(found.items()))})"
        )
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Command line: `python -m mpidp doctor` (also installed as the `mpidp` command)."""

import argparse
import sys


def main(argv=None) -> int:
    """Parse the command line and run the sub-command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="mpidp", description="mpidp command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser(
        "doctor", help="check MPI, torch and the MPIDP_* knobs; smoke-test the collectives",
        description="Check the MPI library, its thread level and CUDA awareness, NCCL/gloo, "
                    "torch and the MPIDP_* knobs that are set. Under a launcher (mpiexec -n 2 "
                    "python -m mpidp doctor) it also runs an allreduce, an allgather and a "
                    "broadcast and checks their results. Rank 0 prints the report; the exit "
                    "code is 0 only when every check passed.")
    doctor.add_argument("--timeout", type=float, default=60.0,
                        help="seconds each smoke-test collective may take (default 60)")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .doctor import run
        return run(timeout=args.timeout)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

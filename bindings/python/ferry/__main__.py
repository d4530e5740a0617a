"""python3 -m ferry --version: the package's version, where its extension and policies are.
python3 -m ferry trace FILE...: what `ferry trace` prints for trace files, one per rank: Ferry's own
(trace_path=, FERRY_TRACE) or torch.profiler's (which rank each collective waited for)."""
import argparse
import os
import sys

import ferry


def trace(argv):
    parser = argparse.ArgumentParser(
        prog="python3 -m ferry trace",
        description="Summarizes trace files, one per rank: Ferry's (per stage, beside the ceilings given; each "
                    "iteration; the ranks reaching their step and ending their update of it) or torch.profiler's "
                    "(per kind of collective, how far apart the ranks started it, which rank came last and whether "
                    "its host launched it late; each rank's compute stream's idle time). The `ferry` command prints "
                    "the same and also measures ceilings and draws a step's timeline.")
    parser.add_argument("files", nargs="+", metavar="FILE")
    parser.add_argument("--ceiling", default="", metavar="KEY=GBPS,...",
                        help="ceilings in GB/s for Ferry's traces, e.g. d2h=55,h2d=55,mem=120,disk=5")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(ferry._ferry.trace_report(args.files, args.ceiling))
    except ferry.InvalidArgumentError as e:  # a bad --ceiling, a malformed file, files not read together
        print("python3 -m ferry trace: %s" % e, file=sys.stderr)
        sys.exit(2)
    except ferry.FerryError as e:
        sys.exit("python3 -m ferry trace: %s" % e)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trace"]:
        return trace(argv[1:])
    parser = argparse.ArgumentParser(prog="python3 -m ferry", description="Ferry's Python package; "
                                     "`python3 -m ferry trace FILE...` summarizes trace files")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--info", action="store_true", help="print the version, the module and the policies")
    args = parser.parse_args(argv)
    if args.info:
        print("ferry %s\nmodule: %s\npolicies: %s (%s)" % (
            ferry.__version__, ferry._ferry.__file__, ferry.policy_dir(),
            ", ".join(sorted(f[:-4] for f in os.listdir(ferry.policy_dir()) if f.endswith(".lua")))))
    elif args.version:
        print("ferry %s" % ferry.__version__)
    else:
        parser.print_help()


if __name__ == "__main__":
    main()

"""python3 -m ferry --version: the package's version, where its extension and policies are."""
import argparse
import os

import ferry


def main():
    parser = argparse.ArgumentParser(prog="python3 -m ferry", description="Ferry's Python package")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--info", action="store_true", help="print the version, the module and the policies")
    args = parser.parse_args()
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

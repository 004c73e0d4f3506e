"""`python -m mlaserve.launch_server [flags]`: the same server and flags as `mlaserve serve`."""

import sys

from mlaserve.server.launch import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m mlaserve.launch_server"))

#!/usr/bin/env bash
# 3 prefill + 1 decode instances behind the router (see launch_xpyd.sh for settings).
#   MODEL=/path/to/model bash run_3p1d.sh
exec env NUM_PREFILL=3 NUM_DECODE=1 bash "$(dirname "${BASH_SOURCE[0]}")/launch_xpyd.sh"

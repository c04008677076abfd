#!/usr/bin/env bash
# 1 prefill + 3 decode instances behind the router (see launch_xpyd.sh for settings).
#   MODEL=/path/to/model bash run_1p3d.sh
exec env NUM_PREFILL=1 NUM_DECODE=3 bash "$(dirname "${BASH_SOURCE[0]}")/launch_xpyd.sh"

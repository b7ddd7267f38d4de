#!/usr/bin/env bash
# A copy of the runtime and bench/ at an earlier commit, for a same-machine A/B on the device:
#   bash bench/make_base.sh <commit>      # -> .abbase/ (ignored by git; ~2 MB: name it in the device call's carry)
# then, on the device, a run_device.sh target that takes BASE_DIR (e.g. `BASE_DIR=.abbase bash bench/run_device.sh
# moe-base-ab`) runs the same benchmark from that copy: its scripts put their own tree first on sys.path.
set -euo pipefail
commit=${1:?usage: make_base.sh <commit>}
rm -rf .abbase && mkdir -p .abbase
git archive "$commit" hybrid state_pool attention graphs bench \
  | tar -x -C .abbase --exclude=hybrid/default_model --exclude=bench/results
echo "$commit" > .abbase/COMMIT
du -sh .abbase

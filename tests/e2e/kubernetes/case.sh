#!/usr/bin/env bash
# Runs one case of cases.sh in a process of its own, so that `set -e` holds inside it (bash
# ignores it in a function whose status a caller tests). run.sh exports what the case needs.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=cases.sh
. "$E2E_DIR/cases.sh"
"case_$1"

"""``python -m fastdiag.kernel_report SHAPES_JSON [ARCHS_JSON]``: the report as JSON rows (the
subprocess `kernel_report` runs under TRITON_INTERPRET=1)."""
import json
import sys

from fastdiag.kernel_report import kernel_report

archs = tuple(json.loads(sys.argv[2])) if len(sys.argv) > 2 else (90,)
print(json.dumps([r.row() for r in kernel_report(json.loads(sys.argv[1]), archs=archs)]))

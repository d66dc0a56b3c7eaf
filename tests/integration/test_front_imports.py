"""The data-parallel front is not on the path of one update: one server never imports it."""

import subprocess
import sys


def test_neither_the_package_nor_one_server_imports_the_front():
    code = (
        "import sys, weightsync, weightsync.serve.app; "
        "print(sorted(m for m in sys.modules if m.startswith('weightsync.serve._front'))); "
        "import weightsync.serve._front.app"  # the front is a subpackage of its own
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

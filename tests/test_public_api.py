"""Every public name the package advertises resolves, and the torch-free modules stay torch-free."""
import subprocess
import sys

import nxdi_common


def test_every_exported_name_imports():
    for name in nxdi_common.__all__:
        assert getattr(nxdi_common, name) is not None, name


def test_importing_package_and_block_manager_does_not_import_torch():
    code = ("import sys, nxdi_common, nxdi_common.block_manager, nxdi_common.bucketing;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

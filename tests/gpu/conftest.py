"""GPU tests: `pytest -m gpu tests/gpu` on a CUDA machine (bench/run_device.sh); skipped without CUDA."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


def pytest_runtest_logreport(report):
    """A failure's traceback as it happens, not only in the summary at the end: a device call cut by
    its time limit (bench/run_device.sh) still shows why each failed test failed."""
    if report.failed and "tests/gpu/" in report.nodeid.replace("\\", "/"):
        import sys

        sys.stderr.write(f"\n--- {report.nodeid} ({report.when}) failed:\n{report.longreprtext[-4000:]}\n")
        sys.stderr.flush()

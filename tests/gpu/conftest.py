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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Once a failed GPU test's report is written (its traceback is text by then), its frames are cleared: their
    locals (an engine and its model, up to tens of GB) would otherwise stay alive with the traceback, and the
    tests after it would fail for want of GPU memory instead of for their own reasons."""
    yield
    if call.excinfo is None or not torch.cuda.is_available():
        return
    import gc
    import sys
    import traceback

    traceback.clear_frames(call.excinfo.tb)
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):  # (pytest keeps these for pdb)
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    torch.cuda.empty_cache()

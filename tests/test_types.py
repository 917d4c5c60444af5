"""The package type-checks: mypy with setup.cfg's [mypy] sections, strict on prefix_service/engine,
server and fleet. Among other things this checks Engine and TemplateRegistry, and the fleet's
FleetEngine and FleetRegistry, against the interfaces the server drives (server/interfaces.py).
The test extra installs mypy (CI runs this through `make test`)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (it comes with the test extra: pip install -e '.[test]')")
def test_package_type_checks():
    result = subprocess.run([sys.executable, "-m", "mypy", "-p", "prefix_service"], cwd=REPO, capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, f"mypy reports errors:\n{result.stdout}{result.stderr}"

"""The package type-checks: mypy with setup.cfg's [mypy] sections, strict on prefix_service/engine,
server and fleet. Among other things this checks Engine and TemplateRegistry, and the fleet's
FleetEngine and FleetRegistry, against the interfaces the server drives (server/interfaces.py).
The test extra installs mypy (CI runs this through `make test`).

mypy keeps its cache beside the native library's builds (`$PREFIX_SERVICE_CACHE_DIR`, default
`~/.cache/prefix_service`), not in the checkout: a fresh clone then checks against what an earlier
run on the machine cached (mostly the third-party packages' types, ~45 s to read cold here) and
analyses again only the modules whose sources differ."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("PREFIX_SERVICE_CACHE_DIR") or Path.home() / ".cache" / "prefix_service") / "mypy"


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (it comes with the test extra: pip install -e '.[test]')")
def test_package_type_checks():
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(CACHE), "-p", "prefix_service"],
                            cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, f"mypy reports errors:\n{result.stdout}{result.stderr}"

"""The megatron-core 0.19.2 oracle's harness (:mod:`parity_tests.megatron019`) itself: a
world's zygote imports the sources once for all its ranks (a rank's own call finds them
and imports nothing again), and a fetch writes their bytecode once (imports with
``PYTHONDONTWRITEBYTECODE`` set would compile every module again in every world).

Skipped when the 0.19.2 sources or their wheel cannot be had
(``python -m parity_tests.megatron019 fetch``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from parity_tests import megatron019 as m19  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

#: Imports 0.16.1 (site-packages) first where it is installed, then the 0.19.2 sources
#: twice, and prints what each import gave.
_TWICE = """
import json, sys
from parity_tests import megatron019 as m19
try:
    import megatron.core as old
    before = old.__file__
except ImportError:
    before = None
first = m19.import_megatron(sys.argv[1])
core = sys.modules["megatron.core"]
second = m19.import_megatron(sys.argv[1])
print(json.dumps({
    "before": before, "first": first.__file__, "version": core.__version__,
    "same_finalize": second is first, "same_core": sys.modules["megatron.core"] is core,
    "fence": m19._fence is sys.modules["megatron.core.tensor_parallel.gtp_api"]
        .wait_for_gtp_grad_reduction_on_current_stream,
}))
"""


def test_a_second_import_in_one_process_reuses_the_sources_imported_first() -> None:
    src = m19.source_dir()
    if src is None:
        pytest.skip(m19.skip_reason())
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", _TWICE, str(src)], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["first"].startswith(str(src)) and got["version"].startswith(m19.VERSION)
    if got["before"] is not None:  # 0.16.1 was imported first: replaced by the sources
        assert not got["before"].startswith(str(src))
    assert got["same_finalize"] and got["same_core"] and got["fence"]


def test_a_fetch_writes_the_bytecode_of_every_source_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheels = sorted((m19.CACHE / "wheel").glob("megatron_core-*.whl"))
    if not wheels:
        pytest.skip("no megatron-core 0.19.2 wheel in the cache (python -m parity_tests.megatron019 fetch)")
    cache = tmp_path / "cache"
    (cache / "wheel").mkdir(parents=True)
    shutil.copy(wheels[-1], cache / "wheel")
    monkeypatch.setattr(m19, "CACHE", cache)
    monkeypatch.delenv(m19.ENV_VAR, raising=False)
    src = m19.fetch()
    assert src == cache / "src" and (src / m19._MARKER).is_file()
    sources = sorted(src.rglob("*.py"))
    missing = [p for p in sources if not Path(importlib.util.cache_from_source(str(p))).is_file()]
    assert len(sources) > 100 and missing == []

"""labutils.plots: figures are saved beside the results, and a saved path prints nothing in a notebook."""
from pathlib import Path

import matplotlib

matplotlib.use("agg")
import matplotlib.pyplot as plt  # noqa: E402

from labutils import plots  # noqa: E402


def test_save_writes_the_figure_and_hides_its_path(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path))
    fig, _ = plt.subplots()
    path = plots.save(fig, "99_test", "empty")
    plt.close(fig)
    assert isinstance(path, Path) and path == tmp_path / "figures" / "99_test-empty.png" and path.is_file()
    assert path._ipython_display_() is None  # IPython calls this instead of printing the repr

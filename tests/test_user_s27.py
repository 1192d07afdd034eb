"""What a notebook user saw go wrong in session 27's walk, each as a fast in-process test.

The walk: five notebooks of its own (a training run split over cells, with ``%nanwatch on`` and ``%%nantrace``, the NaN
in the forward, the loss code, the backward, the optimizer step and the data), run in real kernels (nbclient and
jupyter_client, %debug answered through the stdin channel) on the main venv and on Colab's stack (.venv-colab:
IPython 7.34, ipywidgets 7.7), saved, exported with nbconvert and opened in JupyterLab in headless Chromium.
"""

from __future__ import annotations

import pytest
import torch
from IPython.lib.pretty import pretty
from torch import nn

import nan_magic
from nan_magic.records import Sample
from nan_magic.render.plots import histogram_figure


def _log_domain_report() -> nan_magic.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, fixes=False):
        torch.log(model(torch.randn(8, 4)) - 10).mean().backward()
    return caught.value.report


def test_a_cause_in_a_cell_shows_its_label_and_hint_not_every_fact() -> None:
    """``_nan_report.cause`` in a cell (or ``print(report.cause)``) showed the dataclass repr: the label, then every
    fact as nested tuples, the whole event among them, about 2,300 characters on one line. It shows what the report
    says of a cause, its label and one-line hint; its fields are still there to read."""
    cause = _log_domain_report().cause
    assert cause is not None and cause.label == "log-domain"
    shown = pretty(cause)
    assert shown == f"Cause('log-domain'): {cause.hint}"
    assert str(cause) == f"log-domain: {cause.hint}"
    assert "facts=" not in shown and len(shown) < 400, shown
    assert cause.facts and cause.reading  # the plain data is unchanged


def _legend(sample: Sample) -> list[str]:
    (axes,) = histogram_figure((sample,)).axes
    legend = axes.get_legend()
    return [text.get_text() for text in legend.get_texts()] if legend is not None else []


@pytest.mark.parametrize(
    ("sample", "said"),
    [
        # Adam with eps=0 at a zero gradient: the updated parameter holds no finite value (it read 3.4e+38x).
        (Sample("float32", (), 64, nan=64, posinf=0, neginf=0), None),
        # Its operands exp_avg and sqrt(v): every value 0 (it read 8.51e+40x, from the bar's padding).
        (Sample("float32", (0.0,) * 64, 64, nan=0, posinf=0, neginf=0, zeros=64), None),
        # One value repeated: the ratio to that value, not to the padded range drawn around it (it read 5.67e+37x).
        (Sample("float32", (5.0,) * 8, 8, nan=0, posinf=0, neginf=0), "6.81e+37x"),
    ],
    ids=["no-finite-value", "all-zero", "one-value"],
)
def test_the_histogram_legend_gives_the_dtype_limit_over_a_real_largest_value(sample: Sample, said: str | None) -> None:
    """The live widget's Histograms tab on an optimizer NaN (Adam, eps=0): the output panel, with no finite value,
    said "float32 limit ±3.4e+38: 3.4e+38x the largest |value|", and an all-zero operand "8.51e+40x": the ratio was
    taken to the drawn range (-1..1 without values, padded around one value), not to any value of the tensor."""
    ratios = [text for text in _legend(sample) if "the largest |value|" in text]
    if said is None:
        assert ratios == []
    else:
        assert ratios == [f"float32 limit \u00b13.4e+38: {said} the largest |value|"]


def test_the_help_s_usage_line_names_the_cell_magic_as_typed(ip) -> None:
    """``%%nantrace?`` began ``%nantrace [--warn] [--log] ...``: a line magic that does not exist (typed, IPython says
    it is not found). The usage line names the cell magic; ``%nanwatch?`` keeps its one ``%``."""
    usage = ip.find_cell_magic("nantrace").__doc__.split("[--warn]")[0].split()
    assert usage[-1] == "%%nantrace", usage
    assert ip.find_line_magic("nanwatch").__doc__.split("[--warn]")[0].split()[-1] == "%nanwatch"


def test_the_defer_option_s_help_says_what_it_changes(ip) -> None:
    """``--defer`` said "check once per step instead of per module": the watch it changes (the default, tiered one)
    does not check per module; it checks a step's boundaries, each read as it is made. ``--defer`` keeps those results
    on the device and reads them together (docs/how-it-watches.md, options.py's ``defer``)."""
    words = " ".join(ip.find_cell_magic("nantrace").__doc__.split())
    assert "instead of per module" not in words
    assert "--defer keep the checks' results on the device, read together (default on CUDA)" in words


def test_a_zero_0d_divisor_is_said_in_words_not_as_an_empty_shape() -> None:
    """A loss divided by a mean that came out 0 (``... / (y - 2).abs().mean()`` on a batch of 2s): the cause said
    "divided by zero (`other` () held 1 zero of 1)", an empty shape a reader takes for a garbled sentence."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    y = torch.full((8, 1), 2.0)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, fixes=False):
        (((model(torch.randn(8, 4)) - y) ** 2).mean() / (y - 2.0).abs().mean()).backward()
    hint = caught.value.report.cause.hint
    # (since session 33 the divisor is named as the line writes it where the line says it for certain; the model
    # called by a bare name on the line runs no op at this line: its ops are the model's)
    assert "divided by zero (`(y - 2.0).abs().mean()`, a single number, was 0), giving 1 inf (x/0)" in hint, hint
    assert "` ()" not in hint


def test_a_verified_eps_fix_on_an_x_over_0_says_it_hides_the_inf_not_a_nan() -> None:
    """``h / (h.abs().sum(1, keepdim=True) * 0)``: 86 +inf and 42 -inf, no NaN; the verified eps fix said "the NaN is
    hidden, not fixed". It names what the producer made (a 0/0 keeps "the NaN": tests/test_notebooks_more.py)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)

    def step() -> None:
        h = model(torch.randn(16, 8))
        (h / (h.abs().sum(dim=1, keepdim=True) * 0)).sum().backward()

    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model):
        step()
    report = caught.value.report
    assert report.nan == 0 and report.posinf and report.neginf
    (eps,) = [line for line in report.to_text().splitlines() if line.startswith("  eps: ")]
    assert "verified" in eps and "(the inf is hidden, not fixed" in eps and "NaN" not in eps, eps


def test_reloading_the_extension_says_it_turned_nanwatch_on_off(ip, capsys: pytest.CaptureFixture[str]) -> None:
    """``%nanwatch on``, then ``%reload_ext nan_magic`` (after an upgrade or an edit): the watch ended with the
    unload, without a word, and the next cell's NaN went by unwatched while the user believed it on. The unload
    says so; the watch stays off (tests/test_magics.py holds that an unload ends it)."""
    ip.run_cell("import torch\nfrom torch import nn\nmodel = nn.Linear(4, 1)")
    ip.run_line_magic("nanwatch", "on model")
    capsys.readouterr()
    ip.run_line_magic("reload_ext", "nan_magic")
    said = capsys.readouterr().out
    assert "nan_magic: unloaded, so %nanwatch on is off; after %load_ext nan_magic, %nanwatch on again" in said
    ip.run_line_magic("nanwatch", "status")
    assert "nan_magic: off" in capsys.readouterr().out
    ip.run_line_magic("reload_ext", "nan_magic")  # nothing was on: nothing to say
    assert "unloaded" not in capsys.readouterr().out

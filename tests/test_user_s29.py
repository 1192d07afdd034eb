"""What a notebook user saw go wrong in session 29's walk, each as a fast in-process test.

The walk: five notebooks of its own (tests/notebooks/user_s29/: a BERT-style classifier built from code with an
all-padding example, a VAE whose posterior variance is pushed up until Adam's state overflows, a GAN whose
discriminator saturates into log(0), a diffusion toy whose noise schedule ends at beta 1, a tabular MLP fed a CSV
with one missing value in batch 17), run through nbclient in the main venv and in .venv-colab (IPython 7.34,
ipywidgets 7.7), and in JupyterLab in headless Chromium. tests/test_user_s29_notebooks.py runs them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nan_magic

T = 100


class Denoiser(nn.Module):
    """The diffusion notebook's model: x0 predicted by dividing by sqrt(alphas_bar), which the bad schedule drives
    to 1e-31 long before its last step (betas up to 1.0 instead of 0.02)."""

    def __init__(self, alphas_bar: torch.Tensor) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(17, 64), nn.SiLU(), nn.Linear(64, 16))
        self.register_buffer("alphas_bar", alphas_bar)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.net(torch.cat([x_t, t[:, None].float() / T], 1))
        ab = self.alphas_bar[t][:, None]
        return eps, (x_t - (1 - ab).sqrt() * eps) / ab.sqrt()


def _diffusion_report() -> nan_magic.Report:
    torch.manual_seed(0)
    alphas_bar = torch.cumprod(1 - torch.linspace(1e-4, 1.0, T), 0)
    model = Denoiser(alphas_bar)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data, g = torch.randn(1024, 16), torch.Generator().manual_seed(0)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt):
        for _ in range(5):
            x0, t = data[torch.randint(0, 1024, (64,), generator=g)], torch.randint(0, T, (64,), generator=g)
            noise = torch.randn(x0.shape, generator=g)
            ab = alphas_bar[t][:, None]
            eps, x0_hat = model(ab.sqrt() * x0 + (1 - ab).sqrt() * noise, t)
            loss = F.mse_loss(eps, noise) + 0.1 * F.mse_loss(x0_hat, x0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return caught.value.report


def test_an_overflowed_adam_state_says_why_no_fix_was_tried() -> None:
    """diffusion_schedule.ipynb: the loss of step 0 is 1.6e27 (finite), its gradients 1e26, and Adam's exp_avg_sq
    (their square) overflows. The report named the state, the step and the cause (overflow: clip the gradients),
    and then said nothing of fixes: no "Fixes tried" section and no note, where every other cause with no fitting
    remedy says why none was tried. It now says that the optimizer step's trials cannot shrink the gradient."""
    report = _diffusion_report()
    assert (report.phase.value, report.module, report.step, report.op) == (
        "optimizer", "net.0", 0, "aten.addcmul_.default")
    assert report.cause is not None and report.cause.label == "overflow"
    assert report.fixes == ()
    said = ("no fix was tried: the trials of the Adam step (a tenth of its learning rate, a larger eps) leave its "
            "gradient as large as it was, and clipping it is not one of them")
    text = report.to_text()
    assert f"  note        {said}" in text, text
    assert said in report.to_html()
    # The addcmul's value, Adam's 1 - beta2, read "value: 0.0010000000000000009 (a Python number)".
    assert "\n              value: 0.001 (a Python number)\n" in text, text


def test_a_data_rows_verified_fix_says_it_was_the_failing_step_that_stopped(ip) -> None:
    """tabular_nan_row.ipynb: one NaN in the CSV, at batch 17. skip-batch is verified, and its line said "verified:
    the step came out finite, no loss: the step stopped before its loss code ran", which reads as if leaving the
    row out stopped the step. The step that stopped is the failing one, at the model's input. The row it leaves out
    was said "(rows 5)"; one row is "(row 5)"."""
    torch.manual_seed(0)
    x = torch.randn(640, 6)
    x[17 * 32 + 5, 2] = float("nan")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, 0] * 2), batch_size=32)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    ip.user_ns.update(torch=torch, F=F, loader=loader, model=model,
                      opt=torch.optim.SGD(model.parameters(), lr=1e-2))
    ip.user_ns.pop("_nan_report", None)
    ip.run_cell("%%nantrace -q\nfor step, (xb, yb) in enumerate(loader):\n"
                "    loss = F.mse_loss(model(xb).squeeze(-1), yb)\n"
                "    opt.zero_grad(); loss.backward(); opt.step()\n")
    report = ip.user_ns["_nan_report"]
    assert (report.phase.value, report.module, report.step) == ("data", "", 17)
    (line,) = [line for line in report.to_text().splitlines() if line.startswith("  skip-batch: ")]
    # (session 45: a backward from ones stood in for the loss: verified through the model only; session 46: a tally
    # of its own in the title)
    assert ("(row 5) -> verified through the model only: its forward and a stand-in backward came out finite, no loss: "
            "the failing step stopped before its loss code ran (the backward started from ones into the model's "
            "outputs)") in line, line
    assert "0 of 1 verified, 1 through the model only (no loss of its own computed)" in report.to_text()


GAN = """\
%%nantrace -q
for step in range(40):
    real = real_data[torch.randint(0, 4096, (64,))]
    fake = G(torch.randn(64, 8))
    d_loss = -(torch.log(D(real)) + torch.log(1 - D(fake.detach()))).mean()
    opt_d.zero_grad(); d_loss.backward(); opt_d.step()
    g_loss = torch.log(1 - D(fake)).mean()
    opt_g.zero_grad(); g_loss.backward(); opt_g.step()
"""


def test_a_gan_s_layer_table_says_which_model_each_row_is_in(ip) -> None:
    """gan_saturate.ipynb: G and D are both ``nn.Sequential``. The Layers table (text, HTML, widget) read
    "Sequential (root)" on all six model rows and "0 (Linear)" twice among the rows not measured: which of the two
    models saturated could not be read off it. Where a step's rows are of several models, each says which."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    D = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())
    ip.user_ns.update(torch=torch, G=G, D=D, real_data=torch.randn(4096, 2) * 0.1 + torch.tensor([4.0, 4.0]),
                      opt_g=torch.optim.Adam(G.parameters(), lr=1e-2), opt_d=torch.optim.Adam(D.parameters(), lr=1e-1))
    ip.user_ns.pop("_nan_report", None)
    ip.run_cell(GAN)
    report = ip.user_ns["_nan_report"]
    assert (report.phase.value, report.module, report.step, report.op) == ("forward", None, 17, "aten.log.default")
    text = report.to_text()
    table = text[text.index("Layers of step 17"):].split("\n\n")[0].splitlines()
    rows = [" ".join(line.split()) for line in table[2:]]
    assert rows[0].startswith("0 ok 0 0 0 Sequential (root) in G forward output float32 64x2"), rows
    assert rows[2].startswith("2 ok 0 0 0 Sequential (root) in D forward output float32 64x1"), rows
    assert "not measured 0 (Linear) in G forward" in rows and "not measured 3 (Sigmoid) in D forward" in rows, rows
    assert "Sequential (root) in D" in report.to_html()
    # The Histograms tab's list of the other layers' samples read "(root) input[0]", "(root) output" for both.
    from nan_magic.render.widget import HistogramsView

    titles = [label.split(": ", 1)[1] for label, _ in HistogramsView(report).selector.options if ": " in label]
    assert titles[3:7] == ["input[0] of G", "output of G", "input[0] of D", "output of D"], titles
    assert not [title for title in titles if "(root)" in title], titles
    # One model, as before: no "in model" on every row.
    assert " in " not in " ".join(layer_row for layer_row in _one_model_rows())


def _one_model_rows() -> list[str]:
    report = _diffusion_report()
    text = report.to_text()
    return text[text.index("Layers of step 0"):].split("\n\n")[0].splitlines()[2:]

"""The report's pictures: simulated and measured timelines one above the other, memory per rank;
and the training curves (loss and step time per step, ``curves_figure``).

A timeline is drawn from *lanes*: ``{lane name: [Span, ...]}`` with times in seconds from
the start of the step.  ``autopar.report.timelines`` turns the simulator's timeline and
the runtime's torch.profiler trace into lanes; this module only draws (matplotlib, Agg).
"""
from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

if TYPE_CHECKING:
    from autopar.report.curves import CurveData

CATEGORY_COLORS = {
    "fwd": "#4C72B0", "bwd": "#DD8452", "recompute": "#937860", "comm": "#55A868",
    "optimizer": "#C44E52", "other": "#8C8C8C",
}


@dataclass(frozen=True)
class Span:
    start_s: float
    dur_s: float
    category: str            # a key of CATEGORY_COLORS
    label: str = ""


Lanes = dict[str, list[Span]]


def report_figure(simulated: Lanes, measured: Lanes | None, memory_sim_bytes: list[float],
                  memory_meas_bytes: list[float] | None, title: str):
    """A matplotlib Figure: timelines (simulated above measured) left, memory per rank right."""
    n_sim, n_meas = max(1, len(simulated)), max(1, len(measured or {}))
    height = 2.0 + 0.32 * (n_sim + n_meas)
    fig = plt.figure(figsize=(14, height), constrained_layout=True)
    grid = fig.add_gridspec(2, 2, width_ratios=[3.2, 1], height_ratios=[n_sim + 1, n_meas + 1])
    ax_sim = fig.add_subplot(grid[0, 0])
    ax_meas = fig.add_subplot(grid[1, 0], sharex=ax_sim)
    ax_mem = fig.add_subplot(grid[:, 1])
    _draw_lanes(ax_sim, simulated, "simulated")
    if measured:
        _draw_lanes(ax_meas, measured, "measured (torch.profiler)")
    else:
        ax_meas.text(0.5, 0.5, "no measured timeline: run with --profile", ha="center", va="center",
                     transform=ax_meas.transAxes)
        ax_meas.set_yticks([])
    ax_meas.set_xlabel("time in step (ms)")
    _draw_memory(ax_mem, memory_sim_bytes, memory_meas_bytes)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in CATEGORY_COLORS.values()]
    ax_sim.legend(handles, list(CATEGORY_COLORS), ncol=len(CATEGORY_COLORS), fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=10)
    return fig


def curves_figure(data: "CurveData", title: str):
    """A matplotlib Figure: loss (and validation loss) per step left, step time per step right
    with the measured median and the simulated step time as horizontal lines."""
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(12, 3.8), constrained_layout=True)
    if data.losses:
        ax_loss.plot(data.loss_steps, data.losses, color="#4C72B0", lw=1.2, label="training loss")
    if data.val_losses:
        ax_loss.plot(data.val_steps, data.val_losses, "o-", color="#DD8452", ms=4, lw=1.2, label="validation loss")
    if not (data.losses or data.val_losses):
        ax_loss.text(0.5, 0.5, "no losses in measured.json", ha="center", va="center", transform=ax_loss.transAxes)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss", fontsize=9, loc="left")
    ax_loss.grid(alpha=0.3)
    if data.losses or data.val_losses:
        ax_loss.legend(fontsize=7, loc="best")
    if data.step_times_s:
        ax_time.plot(data.time_steps, [t * 1e3 for t in data.step_times_s], ".-", color="#DD8452", ms=3, lw=1.0,
                     label="measured step time")
        ax_time.axhline(data.measured_step_time_s * 1e3, color="#DD8452", ls=":", lw=1.0,
                        label=f"measured median after warm-up {data.measured_step_time_s * 1e3:.3g} ms")
    else:
        ax_time.text(0.5, 0.5, "no step times in measured.json", ha="center", va="center", transform=ax_time.transAxes)
    if data.simulated_step_time_s:
        ax_time.axhline(data.simulated_step_time_s * 1e3, color="#4C72B0", ls="--", lw=1.2,
                        label=f"simulated {data.simulated_step_time_s * 1e3:.3g} ms")
    ax_time.set_xlabel("step")
    for ax in (ax_loss, ax_time):                       # steps are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_time.set_ylabel("step time (ms)")
    ax_time.set_ylim(bottom=0)
    ax_time.set_title("step time", fontsize=9, loc="left")
    ax_time.grid(alpha=0.3)
    ax_time.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    return fig


def figure_png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _draw_lanes(ax, lanes: Lanes, title: str) -> None:
    names = list(lanes)
    for i, name in enumerate(names):
        bars = [(s.start_s * 1e3, max(s.dur_s * 1e3, 1e-6)) for s in lanes[name]]
        colors = [CATEGORY_COLORS.get(s.category, CATEGORY_COLORS["other"]) for s in lanes[name]]
        if bars:
            ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=colors, edgecolor="none")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=7)
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)


def _draw_memory(ax, sim: list[float], meas: list[float] | None) -> None:
    ranks = list(range(max(len(sim), len(meas or []))))
    width = 0.4
    ax.bar([r - width / 2 for r in ranks[:len(sim)]], [b / 2**20 for b in sim], width, label="simulated",
           color="#4C72B0")
    if meas:
        ax.bar([r + width / 2 for r in ranks[:len(meas)]], [b / 2**20 for b in meas], width, label="measured",
               color="#DD8452")
    ax.set_xticks(ranks)
    ax.set_xlabel("rank")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title("memory per rank", fontsize=9, loc="left")
    ax.legend(fontsize=7, loc="best")

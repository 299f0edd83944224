"""The paper's situations, through the real runtime on the simulated host (fake clock)."""

from __future__ import annotations

from tenon.policy.config import PAPER_RESERVES, PolicyConfig
from tenon.predict.static import FixedPredictor
from tenon.runtime.controller import Runtime
from tenon.runtime.simulate import SimAction, SimWorkflow, simulate
from tenon.sandbox.sim import SimDomain

MIB = 1024 * 1024
GIB = 1024 * MIB


def burst(n: int, *, steps: int = 3, avg: int = 200 * MIB, peak: int = 320 * MIB,
          duration_s: float = 2.0, wait_s: float = 2.0) -> list[SimWorkflow]:
    action = SimAction(avg, peak, duration_s, 32 * MIB, model_wait_s=wait_s)
    return [SimWorkflow([action] * steps) for _ in range(n)]


def test_synchronized_burst_tenon_completes_without_oom_where_eager_fails() -> None:
    workflows = burst(13)  # 13 x 320 MiB of peaks on 1 GiB: ~4x oversubscribed
    predictor = FixedPredictor(200 * MIB, 320 * MIB)
    tenon = simulate(workflows, budget_bytes=GIB, policy="tenon", predictor=predictor)
    eager = simulate(workflows, budget_bytes=GIB, policy="eager", predictor=predictor)
    static2 = simulate(workflows, budget_bytes=GIB, policy="static-2", predictor=predictor)

    assert tenon.num_oom_kills == 0
    assert all(r.completed and len(r.results) == 3 for r in tenon.runs)
    assert tenon.peak_bytes <= GIB
    assert eager.num_oom_kills > 0
    assert not all(r.completed for r in eager.runs)
    # The gate held actions, before their start or mid-growth (otherwise this burst would
    # have been OOM-killed like eager)...
    held = [e for e in tenon.of_kind("gate") if not e["allowed"]] + tenon.of_kind("start_held")
    assert held
    # ...and control still beats the safe static limit on the same burst.
    assert all(r.completed for r in static2.runs)
    assert tenon.makespan_s < static2.makespan_s


def test_heavy_action_is_not_starved_by_a_stream_of_light_ones() -> None:
    light = SimAction(150 * MIB, 250 * MIB, 1.0, 0)
    heavy = SimAction(1200 * MIB, 1500 * MIB, 2.0, 0, action_class="test_runner")
    # light workflows arrive every 0.25 s for 60 s; the heavy one arrives at t=5
    stream = [SimWorkflow([light], submit_s=0.25 * i) for i in range(240)]
    workflows = [*stream, SimWorkflow([heavy], submit_s=5.0)]

    class ByClass:
        name = "by-class"

        def observe(self, context, measured):
            pass

        def observe_running(self, context, peak_bytes):
            pass

        def predict(self, context):
            from tenon.predict.base import Prediction

            if context.action_class == "test_runner":
                return Prediction(1200 * MIB, 1500 * MIB)
            return Prediction(150 * MIB, 250 * MIB)

    report = simulate(workflows, budget_bytes=2 * GIB, policy="tenon", predictor=ByClass())
    heavy_run = report.runs[-1]
    assert heavy_run.completed
    assert report.num_oom_kills == 0
    heavy_admit = next(e for e in report.of_kind("admit") if e["heavy"])
    # admitted while light actions were still arriving (the stream runs to t=60)
    assert heavy_admit["t"] < 40.0
    admits = report.of_kind("admit")
    later_light = [e for e in admits if not e["heavy"] and e["t"] > heavy_admit["t"]]
    assert later_light, "the light stream kept flowing after the heavy action was admitted"


def test_sandbox_that_keeps_growing_is_held_under_red_with_one_probe() -> None:
    # Two actions predicted at 100 MiB that really grow to 700 MiB each, slowly, on 1 GiB:
    # together they would OOM; the gate must hold one of them once pressure turns red.
    grower = SimAction(600 * MIB, 700 * MIB, 20.0, 0)
    workflows = [SimWorkflow([grower]), SimWorkflow([grower])]
    predictor = FixedPredictor(50 * MIB, 100 * MIB)
    # the paper's reserves: the default, smaller ones hold the second grower before red
    report = simulate(workflows, budget_bytes=GIB, policy="tenon", predictor=predictor,
                      config=PolicyConfig(**PAPER_RESERVES))
    assert report.num_oom_kills == 0
    assert all(r.completed for r in report.runs)
    denials = [e for e in report.of_kind("gate") if not e["allowed"]]
    assert denials
    # green holds only the one that outgrew its prediction second, while the first's
    # demand leaves it no room
    assert all(e["pressure"] in ("yellow", "red") or "outgrew its prediction after"
               in e["reason"] for e in denials)
    assert any(e["pressure"] == "red" for e in report.of_kind("sample"))
    # never two growers released together under red
    samples = [e for e in report.of_kind("sample") if e["pressure"] == "red"]
    assert all(e["running"] - e["held"] <= 1 for e in samples)
    eager = simulate(workflows, budget_bytes=GIB, policy="eager", predictor=predictor)
    assert eager.num_oom_kills > 0


def test_pressure_recovers_to_green_when_the_budget_grows_back() -> None:
    workflows = burst(10, steps=4)
    predictor = FixedPredictor(200 * MIB, 320 * MIB)
    levels: list[tuple[float, str, int]] = []

    async def grow_budget(runtime: Runtime, domain: SimDomain, clock) -> None:
        await clock.sleep(10.0)
        domain.set_budget(8 * GIB)
        while True:
            last = runtime.execution.last_pressure
            if last is not None:
                levels.append((clock.now(), last.level.name, runtime.execution.gate.aimd.b))
            await clock.sleep(0.5)

    report = simulate(workflows, budget_bytes=GIB, policy="tenon", predictor=predictor,
                      during=grow_budget)
    assert report.num_oom_kills == 0
    assert all(r.completed for r in report.runs)
    before = [e for e in report.of_kind("sample") if e["t"] < 10.0]
    assert any(e["pressure"] != "green" for e in before)
    after = [lvl for t, lvl, _ in levels if t > 10.5]
    assert after
    assert all(lvl == "GREEN" for lvl in after)
    # b grows back by one per 5 s of continuous green, up to bmax
    assert max(b for t, _, b in levels if t > 10.5) > 1
    # with room again, actions run side by side
    assert max(e["running"] for e in report.of_kind("sample") if e["t"] > 11.0) >= 5

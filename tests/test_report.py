from selfrl.report.run import write_report
from selfrl.record.store import Store


def test_report_numbers_and_plots(tmp_path):
    with Store(tmp_path / "selfrl.db") as store:
        run = store.start_run({"model": "tiny"})
        for step in range(4):
            store.log_metrics(run, step, {"reward/mean": 0.1 * step, "kl": 0.01 * step, "loss": 1.0 - 0.1 * step})
            store.log_metrics(run, step, {"grad_norm": float("nan")})  # nothing finite: no plot
        store.log_metrics(run, 0, {"val/success": 0.4})
        store.log_metrics(run, 3, {"val/success": 0.8})
        store.add_version(0, None, None, "base")
        store.add_version(1, 0, "/ckpt/1", "promoted")
        store.add_version(2, 1, "/ckpt/2", "rejected", {"val/success": 0.7})
        tasks = ["v1", "v2", "v3", "v4", "v5"]
        before = [False, False, True, True, False]
        after = [True, False, True, True, True]
        store.add_evaluation(0, [(t, ok, None) for t, ok in zip(tasks, before)])
        store.add_evaluation(1, [(t, ok, None) for t, ok in zip(tasks, after)])
        summary = {
            "base_version": 0,
            "final_version": 1,
            "time_inference_s": 100.0,
            "time_training_s": 50.0,
            "time_validation_s": 25.0,
            "num_trajectories": 64,
        }
        path = write_report(tmp_path / "out", store, run, summary)

    text = path.read_text()
    assert path == tmp_path / "out" / "report.md"
    # before 2/5: Wilson [0.118, 0.769] (see test_stats).
    # after 4/5: center = (0.8 + 0.38416) / 1.76832 = 0.66965,
    # half = 1.96 * sqrt(0.032 + 0.038416) / 1.76832 = 0.29412 -> [0.376, 0.964]
    assert "2/5 = 0.400 [0.118, 0.769]" in text
    assert "4/5 = 0.800 [0.376, 0.964]" in text
    # paired d = [1,0,0,0,1]: +0.400, CI [-0.080, +0.880]
    assert "+0.400, 95% CI [-0.080, +0.880]" in text
    # (100 + 50) / 100
    assert "Cost ratio (inference + training) / inference: 1.50" in text
    assert "| inference | 100.0 | 57.1% |" in text
    assert "| 2 | 1 | rejected | 0.700 |" in text
    assert "| num_trajectories | 64 |" in text
    plots = tmp_path / "out" / "plots"
    for name in ["reward_mean", "kl", "val_success", "loss"]:
        png = plots / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(plots/{name}.png)" in text
    assert not (plots / "grad_norm.png").exists()


def test_report_with_missing_data(tmp_path):
    with Store(tmp_path / "selfrl.db") as store:
        run = store.start_run({})
        path = write_report(tmp_path / "out", store, run, {"base_version": 0, "final_version": 3})
    text = path.read_text()
    assert "not evaluated" in text
    assert "No metrics were logged." in text
    assert "Cost ratio (inference + training) / inference: n/a" in text
    assert not (tmp_path / "out" / "plots").exists()

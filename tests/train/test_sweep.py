import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "sweep", Path(__file__).resolve().parents[2] / "scripts" / "sweep.py"
)
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)


def test_grid_expansion_and_one_run_name_per_job():
    jobs = sweep.expand(["experiment=debug", "a=1,2", "b=[1,2]", "c=x,y"])
    assert jobs[0] == ["experiment=debug", "a=1", "b=[1,2]", "c=x"] and len(jobs) == 4
    names = {sweep.job_name("s", job, {"a", "c"}) for job in jobs}
    assert len(names) == 4 and "s-a=1-c=x" in names

"""ddp_scripts/template_ddp.py, used as a user would: copied with ddp_hardening.py into an empty
folder it trains with both launchers; then another project is swapped in (its own data file, model, loss and
metrics: the YOUR PROJECT functions replaced, nothing else), and the copy trains, saves a
checkpoint that loads into the plain model, refuses a bad flag and a missing data file in one line
each, and ends whole when a rank is killed."""
import difflib
import importlib.util
import os
import random
import shutil
import signal
import sys
import time

import pytest
import torch
from helpers import SCRIPTS, ends_promptly_and_whole, read_metrics, run_script, torchrun, training_job

TEMPLATE = SCRIPTS / "template_ddp.py"
HARDENING = SCRIPTS / "ddp_hardening.py"  # the module the template imports, copied beside it
START, END = (next(line for line in TEMPLATE.read_text().splitlines(keepends=True)
                   if line.startswith("# ===") and line.rstrip().endswith(part))
              for part in ("YOUR PROJECT", "DDP steps"))

# Another project, as its author would write it into the YOUR PROJECT part: a classifier of 3
# classes from 4 measurements, read from a CSV file of its own; Adam; loss and accuracy.
PROJECT = START + '''DESCRIPTION = "Classify measurements into 3 classes."


def add_project_flags(parser):
    parser.add_argument("--data", type=str, default="measurements.csv",
                        help="CSV, one sample a row: 4 measurements, then the class (0, 1 or 2)")
    parser.add_argument("--hidden", type=positive(int), default=32)


prepare_data = None  # the data file is already there


def load_datasets(args):
    try:
        with open(args.data) as f:
            rows = [[float(v) for v in line.split(",")] for line in f if line.strip()]
    except OSError as err:
        raise UsageError(f"cannot read the data file {args.data}: {err.strerror}") from None
    data = torch.tensor(rows)
    x, y, split = data[:, :4], data[:, 4].long(), len(data) * 4 // 5
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:]), {}


def build_model(args, info):
    return nn.Sequential(nn.Linear(4, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 3))


def make_optimizer(model, args):
    return torch.optim.Adam(model.parameters(), lr=args.lr)


def loss_on(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def eval_sums(model, batch):
    x, y = batch
    logits = model(x)
    return {"loss": F.cross_entropy(logits, y, reduction="sum"),
            "accuracy": (logits.argmax(1) == y).sum(), "count": torch.tensor(len(y))}


def metrics(sums):
    return {name: value / sums["count"] for name, value in sums.items() if name != "count"}


def better(metrics, best):
    return True


def checkpoint(model, info):
    return model.state_dict()


def check_setup(args, rank):
    hardening.check_device(args.device, args.backend, nprocs=args.nprocs,
                           gpu=int(os.environ.get("LOCAL_RANK", 0)))
    if rank == 0:
        check_writable(args.save, args.metrics_json)


'''


def write_measurements(path, n=900, seed=0):
    """Three clusters of 4 measurements each, with their class: a data file of the user's own."""
    rng = random.Random(seed)
    centres = [(0, 0, 0, 0), (2, 2, 0, 0), (0, 2, 2, 2)]
    with open(path, "w") as f:
        for i in range(n):
            label = i % 3
            values = [c + rng.gauss(0, 0.6) for c in centres[label]]
            f.write(",".join(f"{v:.4f}" for v in values) + f",{label}\n")


def port(folder):
    """The template copied into `folder` as the user's script, its YOUR PROJECT part replaced by
    PROJECT (with its data file beside it); returns the script's path."""
    text = TEMPLATE.read_text()
    start, end = text.index(START), text.index(END)
    script = folder / "classify_ddp.py"
    script.write_text(text[:start] + PROJECT + text[end:])
    shutil.copy(HARDENING, folder)
    write_measurements(folder / "measurements.csv")
    return script


def launch(folder, script, *args, launcher=None, timeout=180):
    return run_script(folder / script, *args, launcher=launcher, cwd=folder, timeout=timeout)


def one_line_error(result):
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert ": error: " in line
    return line


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user-project")
    return folder, port(folder)


def import_port(script, monkeypatch):
    """A ported script imported as inference code would: its folder (with its copy of
    ddp_hardening.py) first on the path."""
    monkeypatch.syspath_prepend(str(script.parent))
    course_copy = sys.modules.pop("ddp_hardening", None)  # another test may have imported it
    try:
        spec = importlib.util.spec_from_file_location(script.stem, script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop("ddp_hardening", None)
        if course_copy is not None:
            sys.modules["ddp_hardening"] = course_copy
    return module


def test_the_template_and_its_module_in_an_empty_folder_train_with_both_launchers(tmp_path):
    shutil.copy(TEMPLATE, tmp_path)
    shutil.copy(HARDENING, tmp_path)
    spawned = launch(tmp_path, "template_ddp.py", "--nprocs", 2, "--epochs", 2, "--metrics-json", "m.json")
    assert spawned.returncode == 0, spawned.stderr
    assert spawned.stdout.count("done:") == 1 and (tmp_path / "data" / "synthetic_regression.pt").exists()
    losses = [e["train_loss"] for e in read_metrics(tmp_path / "m.json")["epochs"]]
    assert losses[1] < losses[0]
    started = launch(tmp_path, "template_ddp.py", "--epochs", 1, launcher=torchrun(2))
    assert started.returncode == 0, started.stderr
    assert started.stdout.count("done:") == 1 and "2 processes" in started.stdout


def test_porting_a_project_changes_only_its_part_and_few_lines(tmp_path):
    """The port replaces the YOUR PROJECT functions and nothing else; for this project it adds at
    most 40 lines (non-blank) to what it removes: the DDP steps and the hardening stay as they are."""
    script = port(tmp_path)
    template, copy = TEMPLATE.read_text().splitlines(), script.read_text().splitlines()
    changed = [line for line in difflib.unified_diff(template, copy, lineterm="", n=0)
               if line[:1] in "+-" and line[:3] not in ("+++", "---") and line[1:].strip()]
    added = [line for line in changed if line.startswith("+")]
    assert 10 < len(added) <= 40, len(added)
    project = copy[copy.index(START.strip()):copy.index(END.strip())]
    assert all(line[1:] in project for line in added)  # every new line is in the project's part


def test_a_ported_project_trains_and_its_checkpoint_loads_into_the_plain_model(ported, monkeypatch):
    folder, script = ported
    r = launch(folder, script, "--nprocs", 2, "--epochs", 8, "--batch-size", 32, "--lr", 0.01,
               "--save", "model.pt", "--metrics-json", "m.json")
    assert r.returncode == 0, r.stderr
    epochs = read_metrics(folder / "m.json")["epochs"]
    assert epochs[-1]["test_accuracy"] > 0.8 and epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    module = import_port(script, monkeypatch)
    model = module.build_model(module.parse_args([]), {})
    model.load_state_dict(torch.load(folder / "model.pt", weights_only=True))  # strict: every name
    x, y = module.load_datasets(module.parse_args(["--data", str(folder / "measurements.csv")]))[1].tensors
    assert (model(x).argmax(1) == y).float().mean() > 0.8


def test_a_ported_project_trains_under_torchrun(ported):
    folder, script = ported
    r = launch(folder, script, "--epochs", 2, "--metrics-json", "t.json", launcher=torchrun(2))
    assert r.returncode == 0, r.stderr
    assert read_metrics(folder / "t.json")["world_size"] == 2 and r.stdout.count("done:") == 1


def test_a_ported_project_refuses_a_bad_flag_and_a_missing_data_file_in_one_line(ported):
    folder, script = ported
    assert "unrecognized arguments: --epoch 2" in one_line_error(launch(folder, script, "--epoch", 2))
    start = time.monotonic()
    line = one_line_error(launch(folder, script, "--nprocs", 2, "--data", "gone.csv"))
    assert "cannot read the data file gone.csv" in line and time.monotonic() - start < 30


def test_a_killed_rank_of_a_ported_project_ends_the_job_with_nothing_left(ported):
    folder, script = ported
    with training_job(script, None, args=["--epochs", "100000"], cwd=folder) as (launcher, ranks, family):
        os.kill(ranks[1].pid, signal.SIGKILL)
        stderr = ends_promptly_and_whole(launcher, family, since=time.monotonic())
    assert launcher.returncode != 0
    (line,) = stderr.strip().splitlines()
    assert "worker 1 ended with signal SIGKILL" in line


# A project that needs every slot: a regression from a CSV file with a header, a categorical
# column (the model learns an embedding of it: it must know how many categories there are),
# three measurements and the price normalised with the training rows' statistics (which inference
# needs too); RMSE and MAE, in the price's spread (not means of sums); the model with the lowest
# RMSE kept; its own defaults.
REGRESSION = START + '''DESCRIPTION = "Predict a price from a city and three measurements (a CSV regression)."


def add_project_flags(parser):
    parser.add_argument("--data", type=str, default="prices.csv",
                        help="CSV with a header: city, three measurements, the price")
    parser.add_argument("--hidden", type=positive(int), default=32)
    parser.set_defaults(lr=0.003, epochs=6)


prepare_data = None  # the data file is already there


def load_datasets(args):
    try:
        with open(args.data) as f:
            rows = [line.strip().split(",") for line in f if line.strip()][1:]
    except OSError as err:
        raise UsageError(f"cannot read the data file {args.data}: {err.strerror}") from None
    cities = sorted({row[0] for row in rows})
    city = torch.tensor([cities.index(row[0]) for row in rows])
    x = torch.tensor([[float(v) for v in row[1:4]] for row in rows])
    y = torch.tensor([[float(row[4])] for row in rows])
    split = len(rows) * 4 // 5
    # scaled by the training rows' own statistics, which inference needs too
    mean, std, price_mean, price_std = x[:split].mean(0), x[:split].std(0), y[:split].mean(), y[:split].std()
    x, y = (x - mean) / std, (y - price_mean) / price_std
    return (TensorDataset(city[:split], x[:split], y[:split]),
            TensorDataset(city[split:], x[split:], y[split:]),
            {"cities": cities, "mean": mean, "std": std, "price_mean": price_mean, "price_std": price_std})


class PriceModel(nn.Module):
    def __init__(self, cities, hidden):
        super().__init__()
        self.city = nn.Embedding(cities, 4)
        self.net = nn.Sequential(nn.Linear(4 + 3, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, city, x):
        return self.net(torch.cat([self.city(city), x], 1))


def build_model(args, info):
    return PriceModel(len(info["cities"]), args.hidden)


def make_optimizer(model, args):
    return torch.optim.Adam(model.parameters(), lr=args.lr)


def loss_on(model, batch):
    city, x, y = batch
    return F.mse_loss(model(city, x), y)


def eval_sums(model, batch):
    city, x, y = batch
    error = model(city, x) - y
    return {"squared": (error ** 2).sum(), "absolute": error.abs().sum(), "count": torch.tensor(len(y))}


def metrics(sums):
    return {"rmse": (sums["squared"] / sums["count"]) ** 0.5, "mae": sums["absolute"] / sums["count"]}


def better(metrics, best):
    return best is None or metrics["rmse"] < best["rmse"]


def checkpoint(model, info):
    return {"model": model.state_dict(), **info}


def check_setup(args, rank):
    hardening.check_device(args.device, args.backend, nprocs=args.nprocs,
                           gpu=int(os.environ.get("LOCAL_RANK", 0)))
    if rank == 0:
        check_writable(args.save, args.metrics_json)


'''


def port_regression(folder, n=1500, seed=0):
    """The regression project in `folder`, with its data file (a price from a city and three
    measurements, on scales far apart); returns the script's path."""
    text = TEMPLATE.read_text()
    script = folder / "prices_ddp.py"
    script.write_text(text[:text.index(START)] + REGRESSION + text[text.index(END):])
    shutil.copy(HARDENING, folder)
    rng, effect = random.Random(seed), {"Lyon": 40.0, "Lille": -25.0, "Nantes": 10.0, "Nice": 70.0}
    with open(folder / "prices.csv", "w") as f:
        f.write("city,rooms,area,age,price\n")
        for _ in range(n):
            city, rooms = rng.choice(sorted(effect)), rng.randint(1, 6)
            area, age = rng.uniform(20, 200), rng.uniform(0, 80)
            price = effect[city] + 15 * rooms + 1.5 * area - 0.8 * age + rng.gauss(0, 5)
            f.write(f"{city},{rooms},{area:.1f},{age:.1f},{price:.2f}\n")
    return script


def changed_lines(before, after):
    """(non-blank lines removed or added, those of them outside the YOUR PROJECT part)."""
    (b0, b1), (a0, a1) = [(lines.index(START.strip()), lines.index(END.strip())) for lines in (before, after)]
    changed = outside = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        for k in range(i1, i2):
            if before[k].strip():
                changed, outside = changed + 1, outside + (not b0 <= k < b1)
        for k in range(j1, j2):
            if after[k].strip():
                changed, outside = changed + 1, outside + (not a0 <= k < a1)
    return changed, outside


def test_a_project_that_needs_every_slot_changes_no_line_outside_them(tmp_path):
    """The README states the size of this port; the DDP steps and the command line stay as they are."""
    script = port_regression(tmp_path)
    changed, outside = changed_lines(TEMPLATE.read_text().splitlines(), script.read_text().splitlines())
    assert outside == 0
    assert f"changes {changed} lines of it" in (SCRIPTS / "README.md").read_text(), changed


def test_the_regression_keeps_its_best_model_with_what_inference_needs(tmp_path, monkeypatch):
    script = port_regression(tmp_path)
    r = launch(tmp_path, script, "--nprocs", 2, "--save", "best.pt", "--metrics-json", "m.json")
    assert r.returncode == 0, r.stderr
    rmse = [e["test_rmse"] for e in read_metrics(tmp_path / "m.json")["epochs"]]
    assert len(rmse) == 6 and rmse[-1] < rmse[0] / 2  # its own default: 6 epochs
    module = import_port(script, monkeypatch)
    args = module.parse_args(["--data", str(tmp_path / "prices.csv")])
    assert args.lr == 0.003 and args.epochs == 6  # set_defaults in the project's flags counts
    _, test_set, info = module.load_datasets(args)
    saved = torch.load(tmp_path / "best.pt", weights_only=True)
    assert saved["cities"] == info["cities"] == ["Lille", "Lyon", "Nantes", "Nice"]
    assert all(torch.equal(saved[k], info[k]) for k in ("mean", "std", "price_mean", "price_std"))
    city, x, y = test_set.tensors

    def rmse_of(path):
        model = module.build_model(args, saved)
        model.load_state_dict(torch.load(path, weights_only=True)["model"])
        with torch.no_grad():
            return ((model(city, x) - y) ** 2).mean().sqrt().item()

    assert rmse_of(tmp_path / "best.pt") == pytest.approx(min(rmse), rel=1e-4)
    # the RMSE fell every epoch, so the best was the last: a project that calls the worst model
    # better shows that the template keeps what better() chose, not the last epoch's
    worst = script.with_name("prices_worst_ddp.py")
    lower = 'metrics["rmse"] < best["rmse"]'
    worst.write_text(script.read_text().replace(lower, lower.replace("<", ">")))
    r = launch(tmp_path, worst, "--nprocs", 2, "--epochs", 3, "--save", "worst.pt",
               "--metrics-json", "w.json")
    assert r.returncode == 0, r.stderr
    rmse = [e["test_rmse"] for e in read_metrics(tmp_path / "w.json")["epochs"]]
    assert rmse[0] == max(rmse) > min(rmse)
    assert rmse_of(tmp_path / "worst.pt") == pytest.approx(rmse[0], rel=1e-4)
    help_text = launch(tmp_path, script, "--help").stdout
    assert "Predict a price from a city and three measurements" in help_text

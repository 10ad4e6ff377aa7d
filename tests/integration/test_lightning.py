"""Lightning keeps Dpex in the loop (issue 44): a DpexDataLoader handed to
``Trainer.fit`` or returned by ``train_dataloader()`` (with dpex imported in
the hook), on 1 device and under ``ddp`` and ``ddp_spawn`` with 2 CPU
processes. Lightning rebuilds the loader with a DistributedSampler; every
batch must still come from Dpex's batch processes, each sample once per epoch
across ranks, and the loss must fall.

Each script is forked from a warm starter that imported Lightning once
(dpex.testing.programs: its imports take 4 s of CPU); the processes Lightning
starts for its other ranks are new interpreters."""
import json
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from dpex.testing import programs

pytest.importorskip("pytorch_lightning")

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import pytorch_lightning as pl
    from dpex.testing.datasets import Regression as Data  # says whether a Dpex batch process made a sample

    def loader():
        import dpex  # imported in the hook, as some scripts do
        return dpex.DpexDataLoader(Data(), distribute_mode=True, batch_size=8, num_workers=1, shuffle=True)

    class Model(pl.LightningModule):
        def __init__(self, hook):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.hook, self.seen, self.by_dpex, self.losses = hook, [], [], []
        def train_dataloader(self):
            return loader() if self.hook else super().train_dataloader()
        def training_step(self, batch, _):
            x, y, i, by_dpex = batch
            self.seen += i.tolist()
            self.by_dpex += by_dpex.tolist()
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss
        def report(self, kind, **what):  # a file per rank: the ranks' prints would interleave
            with open(f"{kind}-{self.global_rank}.jsonl", "a") as f:
                f.write(json.dumps(dict(rank=self.global_rank, **what)) + "\\n")
        def on_train_epoch_end(self):
            self.report("result", epoch=self.current_epoch, seen=self.seen, by_dpex=all(self.by_dpex))
            self.seen, self.by_dpex = [], []
        def on_train_end(self):
            self.report("loss", falls=sum(self.losses[-3:]) < sum(self.losses[:3]))
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2)  # 8 steps a rank: the fall must show over batch noise

    if __name__ == "__main__":
        strategy, devices, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        model = Model(hook=where == "hook")
        trainer.fit(model, train_dataloaders=None if where == "hook" else loader())
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,devices,where", [("auto", 1, "fit"), ("ddp", 2, "fit"), ("ddp_spawn", 2, "fit"),
                                                     ("auto", 1, "hook"), ("ddp", 2, "hook"), ("ddp_spawn", 2, "hook")])
def test_lightning_keeps_dpex_making_the_batches(tmp_path, strategy, devices, where):
    (tmp_path / "train.py").write_text(SCRIPT)
    done = programs.run(["train.py", strategy, str(devices), where], cwd=str(tmp_path), timeout=280,
                        preload=programs.LIGHTNING)
    assert done.returncode == 0, done.stderr[-4000:]
    def read(kind):
        return [json.loads(line) for path in sorted(tmp_path.glob(f"{kind}-*.jsonl"))
                for line in path.read_text().splitlines()]
    results, losses = read("result"), read("loss")
    assert len(results) == 2 * devices, done.stdout
    assert all(r["by_dpex"] for r in results), results  # never torch's workers in the trainer
    for epoch in range(2):
        seen = [i for r in results if r["epoch"] == epoch for i in r["seen"]]
        assert sorted(seen) == list(range(64))  # each sample once across the ranks
    assert losses and all(loss["falls"] for loss in losses)


RESUME = textwrap.dedent("""
    import json, sys
    import torch
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import TensorDataset

    which, phase, step = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def loader():
        data = TensorDataset(torch.arange(32.0).unsqueeze(1), torch.arange(32))
        kwargs = dict(batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7), num_workers=1)
        if which == "torchdata":
            from torchdata.stateful_dataloader import StatefulDataLoader
            return StatefulDataLoader(data, **kwargs)
        import dpex
        return dpex.DpexDataLoader(data, distribute_mode=True, **kwargs)

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.seen = torch.nn.Linear(1, 1), []
        def training_step(self, batch, _):
            self.seen.append([self.current_epoch, batch[1].tolist()])
            return self.net(batch[0]).pow(2).mean()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    if __name__ == "__main__":
        torch.manual_seed(0)
        # "step": a checkpoint every `step` batches (the run stops there); "epoch": Lightning's default, at an epoch's end
        checkpoint = ModelCheckpoint(dirpath="ck", save_top_k=-1, filename="s{step}",
                                     every_n_train_steps=step if phase == "step" else None)
        stop = dict(max_steps=step) if phase == "step" else dict(max_epochs=1) if phase == "epoch" else {}
        trainer = pl.Trainer(**{"max_epochs": 3, **stop}, accelerator="cpu", devices=1, logger=False,
                             callbacks=[checkpoint], enable_progress_bar=False, enable_model_summary=False)
        model = Model()
        trainer.fit(model, train_dataloaders=loader(), ckpt_path=f"ck/sstep={step}.ckpt" if phase == "resume" else None)
        print(json.dumps(model.seen))
""")


def _lightning_runs(folder, which, *phases):
    """What the loop was given in each phase, run one after the other in ``folder`` (its checkpoints' own)."""
    folder.mkdir(parents=True)
    (folder / "resume.py").write_text(RESUME)
    out = []
    for phase, step in phases:
        done = programs.run(["resume.py", which, phase, str(step)], cwd=str(folder), timeout=120,
                            preload=programs.LIGHTNING)
        assert done.returncode == 0, done.stderr[-4000:]
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.timeout(600)
def test_lightning_resumes_as_with_torchdatas_stateful_loader(tmp_path):
    """8 batches an epoch, 3 epochs. A checkpoint mid-epoch (step 5) resumes exactly; one at an epoch's last batch
    (step 8: the loader's state still has the epoch in progress, as Lightning stops at len() without pulling
    StopIteration) and Lightning's own epoch-end checkpoint resume with the epochs and batches that torchdata's
    StatefulDataLoader gives in the same run (Lightning's doing, not the loader's: see docs/guides/lightning.md)."""
    pytest.importorskip("torchdata")
    # Five runs of their own folders, at once: each is its runs one after the other (a resume reads the checkpoint
    # its run before wrote), and each Lightning process waits for its imports more than the machine's cores.
    chains = {"mid": ("dpex", ("full", 0), ("step", 5), ("resume", 5))}
    for which in ("dpex", "torchdata"):
        chains[f"{which}/last-batch"] = (which, ("step", 8), ("resume", 8))
        chains[f"{which}/epoch-end"] = (which, ("epoch", 8), ("resume", 8))
    with ThreadPoolExecutor(len(chains)) as pool:
        done = {name: pool.submit(_lightning_runs, tmp_path / name, *chain) for name, chain in chains.items()}
        got = {name: future.result() for name, future in done.items()}
    full, first, rest = got["mid"]
    assert len(full) == 24 and first + rest == full  # mid-epoch: exact
    runs, oracle = ([*got[f"{which}/last-batch"], *got[f"{which}/epoch-end"]] for which in ("dpex", "torchdata"))
    assert [[e for e, _ in run] for run in runs] == [[e for e, _ in run] for run in oracle]
    assert runs[0] + runs[1] != full  # and neither is the uninterrupted run: Lightning skips an epoch there

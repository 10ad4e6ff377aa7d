"""Lightning keeps Dpex in the loop (issue 44): a DpexDataLoader handed to
``Trainer.fit`` or returned by ``train_dataloader()`` (with dpex imported in
the hook), on 1 device and under ``ddp`` and ``ddp_spawn`` with 2 CPU
processes. Lightning rebuilds the loader with a DistributedSampler; every
batch must still come from Dpex's batch processes, each sample once per epoch
across ranks, and the loss must fall."""
import json
import subprocess
import sys
import textwrap

import pytest

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
            return torch.optim.SGD(self.parameters(), lr=0.05)

    if __name__ == "__main__":
        strategy, devices, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        model = Model(hook=where == "hook")
        trainer.fit(model, train_dataloaders=None if where == "hook" else loader())
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,devices,where", [("auto", 1, "fit"), ("ddp", 2, "fit"), ("ddp_spawn", 2, "fit"),
                                                     ("ddp", 2, "hook")])
def test_lightning_keeps_dpex_making_the_batches(tmp_path, strategy, devices, where):
    (tmp_path / "train.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, "train.py", strategy, str(devices), where], cwd=tmp_path,
                          capture_output=True, text=True, timeout=280, stdin=subprocess.DEVNULL)
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

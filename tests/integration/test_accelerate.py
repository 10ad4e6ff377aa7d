"""Accelerate with Dpex making the batches (issue 44): dpex.accelerate.prepare_data_loader,
1 process and 2 (torchrun), with gradient accumulation."""
import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("accelerate")

SCRIPT = textwrap.dedent("""
    import json
    import torch
    from accelerate import Accelerator
    import dpex
    import dpex.accelerate
    from dpex.testing.datasets import Regression as Data  # says whether a Dpex batch process made a sample

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)  # the same model on every rank; a held-out set to see the loss fall on
    held_x = torch.randn(256, 4)
    held_y = held_x.sum(1, keepdim=True)
    model = torch.nn.Linear(4, 1)
    before = torch.nn.functional.mse_loss(model(held_x), held_y).item()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = dpex.DpexDataLoader(Data(), distribute_mode=True, batch_size=8, num_workers=1, shuffle=True)
    loader = dpex.accelerate.prepare_data_loader(accelerator, loader)  # instead of accelerator.prepare(loader)
    out = []
    for epoch in range(2):
        seen, by_dpex, ends = [], [], []
        for x, y, i, made_by_dpex in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            seen += i.tolist()
            by_dpex += made_by_dpex.tolist()
            ends.append(accelerator.gradient_state.end_of_dataloader)
        out.append(dict(epoch=epoch, seen=seen, by_dpex=all(by_dpex), ends=ends))
    with open(f"out-{accelerator.process_index}.json", "w") as f:
        with torch.no_grad():
            after = torch.nn.functional.mse_loss(model(held_x), held_y).item()
        json.dump(dict(epochs=out, falls=after < before), f)
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("processes", [1, 2])
def test_accelerate_keeps_dpex_making_the_batches(tmp_path, processes):
    (tmp_path / "train.py").write_text(SCRIPT)
    launch = (["train.py"] if processes == 1 else
              ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), "train.py"])
    done = subprocess.run([sys.executable, *launch], cwd=tmp_path, capture_output=True, text=True, timeout=280,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(processes)]
    for epoch in range(2):
        epochs = [rank["epochs"][epoch] for rank in ranks]
        assert all(e["by_dpex"] for e in epochs)  # never torch's workers in the trainer
        assert sorted(i for e in epochs for i in e["seen"]) == list(range(64))  # each sample once across ranks
        for e in epochs:  # accelerate's end-of-data tracking (gradient accumulation syncs on it)
            assert e["ends"] == [False] * (len(e["ends"]) - 1) + [True]
    assert all(rank["falls"] for rank in ranks)


def test_a_plain_prepare_says_that_torchs_workers_would_make_the_batches(recwarn):
    from accelerate import Accelerator

    import dpex.accelerate
    from dpex.client.compat import ACCELERATE_REBUILDS
    from dpex.testing.datasets import Regression
    accelerator = Accelerator(cpu=True)
    ours = dpex.DpexDataLoader(Regression(), distribute_mode=True, batch_size=8)
    theirs = dpex.DpexDataLoader(Regression(), distribute_mode=True, batch_size=8)
    try:
        dpex.accelerate.prepare_data_loader(accelerator, ours)
        assert not [w for w in recwarn if "accelerator.prepare()" in str(w.message)]
        with pytest.warns(UserWarning, match=r"accelerator\.prepare\(\) rebuilds this DpexDataLoader") as caught:
            shard = accelerator.prepare(theirs)
        assert str(caught[0].message) == ACCELERATE_REBUILDS
        assert type(shard.base_dataloader) is not dpex.DpexDataLoader  # what the warning is about
    finally:
        ours.close()
        theirs.close()

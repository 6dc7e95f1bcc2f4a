"""Two stage processes on one GPU are refused before anything starts (NCCL cannot put two ranks of a group on one
device, so the start would hang): one line naming the stages, the device and what to do.  In process."""

import argparse

import pytest

from launcher.local_cluster import check_gpu_fit


@pytest.mark.unit
@pytest.mark.parametrize(("stages", "gpus"), [(1, 1), (2, 2), (2, 8)])
def test_one_gpu_per_stage_fits(stages, gpus):
    check_gpu_fit("cuda", stages, 1, gpus)


@pytest.mark.unit
def test_two_stages_on_one_gpu_are_refused_naming_stages_device_and_remedy():
    with pytest.raises(ValueError) as info:
        check_gpu_fit("cuda", 2, 1, gpus=1)
    message = str(info.value)
    assert message == (
        "--stages 2 on 1 GPU(s): stages 0 and 1 would share cuda:0, and NCCL cannot put two stages on one GPU; "
        "give --stages 1 or fewer on this machine (or --device cpu)"
    )
    with pytest.raises(ValueError, match="this machine has no GPU that torch can use"):
        check_gpu_fit("cuda", 1, 1, gpus=0)
    check_gpu_fit("cpu", 4, 1, gpus=0)  # CPU stages talk gloo: any number share the machine


@pytest.mark.unit
@pytest.mark.parametrize("command", ["up", "selftest"])
def test_up_and_selftest_refuse_at_once_with_one_line(command, monkeypatch, capsys, tmp_path):
    import torch

    from launcher import selftest, up

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    {"up": up, "selftest": selftest}[command].add_parser(sub)
    argv = [command, "--stages", "2", "--device", "cuda"]
    if command == "up":
        argv += ["--checkpoint", str(tmp_path), "--port", "0", "--gateway-port", "-1"]
    args = parser.parse_args(argv)
    assert args.run(args) == 2  # before any process starts
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "stages 0 and 1 would share cuda:0" in err and "--stages 1" in err, err

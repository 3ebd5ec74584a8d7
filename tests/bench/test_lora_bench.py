"""``python -m pdserve.bench.lora_peer``: without the peer it says so and exits; the servers
it starts carry the same LoRA flags and adapters."""

from __future__ import annotations

import argparse

from pdserve.bench import lora_peer


def test_without_the_peer_it_says_what_to_set_up(tmp_path, capsys):
    lora_peer.main(["--vllm", str(tmp_path / "no-vllm"), "--model", str(tmp_path)])
    assert "the peer is not installed here" in capsys.readouterr().out


def test_both_servers_get_the_same_adapters(tmp_path):
    args = argparse.Namespace(vllm="vllm", model=str(tmp_path), port=8100, rank=8,
                              servers=["vllm", "pdserve-colocated"])
    paths = [tmp_path / "x", tmp_path / "y"]
    servers = lora_peer.lora_servers(args, paths)
    assert [s.name for s in servers] == ["vllm", "pdserve-colocated"]
    for server in servers:
        tail = server.command[server.command.index("--enable-lora"):]
        assert tail == ["--enable-lora", "--max-loras", "16", "--max-lora-rank", "8",
                        "--lora-modules", f"a0={paths[0]}", f"a1={paths[1]}"]

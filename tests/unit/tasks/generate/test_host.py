"""ProducerHost's client: room for every group in flight."""

from rollflow.infra.config import validate_config
from rollflow.tasks.generate.host import inference_pool


def test_the_producers_client_has_a_connection_for_every_group_in_flight():
    # 1024 groups in flight, one request each: with aiohttp's limit at the client's default 256,
    # 768 of them waited in the client, not in vLLM's scheduler (bench/producer_throughput.py).
    cfg = validate_config(
        {
            "model": {"path": "unused"},
            "envs": [{"name": "add"}],
            "train": {"train_batch_size": 512, "mini_batch_size": 512, "max_staleness": 1},
        }
    )
    assert cfg.train.in_flight_groups() == 1024
    pool = inference_pool(cfg, ["http://127.0.0.1:9", "http://127.0.0.1:10"])
    assert [c.max_connections for c in pool.clients.values()] == [1024, 1024]
    small = validate_config({"model": {"path": "unused"}, "envs": [{"name": "add"}]})
    assert inference_pool(small, ["http://127.0.0.1:9"]).clients[0].max_connections == 256

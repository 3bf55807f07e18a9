"""Turning an agent.toml into a ready worker: local data, profile, device, threads."""

from __future__ import annotations

import logging

import torch

from jetsplit.data import (
    Dataset,
    ImageDataset,
    ImageOptions,
    client_shards,
    load_dataset,
    load_dataset_split,
    with_classes,
)
from jetsplit.data.feed import default_workers
from jetsplit.devices import resolve_device
from jetsplit.edge_agent.attacks import Attack, build_attack
from jetsplit.edge_agent.config import AgentConfig, DataSection
from jetsplit.edge_agent.edge import no_data
from jetsplit.edge_agent.emulation import DeviceClock
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.errors import ConfigError
from jetsplit.profiles import resolve_profile


def image_options(data: DataSection) -> ImageOptions:
    """How `[data]` wants images sized, augmented and normalised."""
    return data.image_options(data.seed)


def local_dataset(config: AgentConfig) -> Dataset:
    """The device's own data (`own`), else its shard of the training split (the test split
    stays on the coordinator); relabelled to the run's classes when `[data] classes` names
    them."""
    data = config.data
    if data.index >= data.clients:
        raise ConfigError(f"agent config: data.index {data.index} must be < data.clients "
                          f"{data.clients}")
    options = image_options(data)
    if data.own:
        local = load_dataset(data.dataset, options)
    else:
        train, _ = load_dataset_split(data.dataset, data.test_fraction, data.seed, options)
        shards = client_shards(train.y, data.clients, data.partition, data.seed,
                               train.num_classes)
        local = train.subset(shards[data.index])
    if data.classes is not None:
        if not isinstance(local, ImageDataset):
            raise ConfigError("agent config: data.classes names the classes of a folder: or "
                              f"csv: dataset, not of {data.dataset!r}")
        local = with_classes(local, data.classes)
    return local


def loader_workers(config: AgentConfig) -> int:
    """Decoding processes: `[data] workers`, or what the device's cores allow."""
    return default_workers() if config.data.workers is None else config.data.workers


def pick_device(choice: str) -> str:
    return resolve_device(choice, "agent config: device")


def build_worker(config: AgentConfig) -> AgentWorker:
    logging.getLogger("jetsplit").setLevel(config.log_level.upper())
    if config.threads:
        torch.set_num_threads(config.threads)
    profile = None
    if config.profile:
        profile = resolve_profile(config.profile).model_dump(mode="json")
    state = config.state_path()
    state.mkdir(parents=True, exist_ok=True)
    data = local_dataset(config) if config.role == "client" else no_data()
    return AgentWorker(config.agent, data, role=config.role,
                       seed=config.seed, state_dir=state, device=pick_device(config.device),
                       profile=profile, clock=DeviceClock(config.emulation),
                       threads=config.threads, attack=agent_attack(config),
                       loader_workers=loader_workers(config))


def agent_attack(config: AgentConfig) -> Attack:
    """The `[attack]` an agent config asks for (honest without one; tests only)."""
    spec = None if config.attack is None else config.attack.kind
    return build_attack(spec, config.seed, f"agent {config.agent}: attack")

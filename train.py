"""Train a recipe: ``python train.py +recipe=NAME key=value ...`` (see README.md)."""

import hydra
from omegaconf import DictConfig

from pretrain.config import register_configs
from pretrain.naming import register_resolvers

register_configs()
register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from pretrain.trainer import run, to_config

    run(to_config(cfg), HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()

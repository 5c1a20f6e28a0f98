"""The run configuration: a NeMo-RL v0.7.0 recipe YAML read with NeMo-RL's meaning into one typed `RunConfig`.

Modules: ``run_config`` (loading, the arm, cross-key checks), ``schema`` (every implemented key), ``yaml_tree`` (YAML,
``defaults:`` chains and overrides into one plain dict), ``nemo_rl_keys`` (every other NeMo-RL key: ignored or
refused), ``switches`` (numerics and checking switches), ``arm_switches`` (which NeMo-RL switches select which arm),
``nemo_rl_upstream`` (NeMo-RL's own YAMLs, the key table's source). The names most callers need are here.
"""

from jetrl_megatron.rl.config.run_config import REPO_ROOT, RunConfig, arm_overrides, load_config, to_yaml
from jetrl_megatron.rl.config.yaml_tree import ConfigError

__all__ = ["REPO_ROOT", "ConfigError", "RunConfig", "arm_overrides", "load_config", "to_yaml"]

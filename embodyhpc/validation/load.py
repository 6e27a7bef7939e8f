"""Loading a recipe, whole: config/load.py reads and merges the layers and builds the schema's types (each section's
own checks), then validate() runs the registries' checks; an error names the layer (file or override) that set its
key, as every other recipe error does."""

from __future__ import annotations

from pathlib import Path

from embodyhpc.config.load import LoadedRecipe, located, merge_recipe, read_config_file, resolve_located
from embodyhpc.config.schema import Config
from embodyhpc.errors import ConfigError
from embodyhpc.validation.registries import validate


def load_recipe(recipe: str, overrides: list[str] | tuple[str, ...] = (), site: str | None = None,
                *, recipe_site_keys: str = "refuse", unread: tuple[str, ...] = ()) -> LoadedRecipe:
    """The one entry point: a validated, frozen config plus its resolved parallel layout.

    recipe_site_keys and unread: as config/load.py merge_recipe takes them ("keep" reloads a run's resolved.yaml;
    unread keys a command never reads may stay `???`).
    """
    config, provenance, recipe_name, site_name = load_unresolved(recipe, overrides, site,
                                                                 recipe_site_keys=recipe_site_keys, unread=unread)
    resolved = resolve_located(config, provenance)
    return LoadedRecipe(config=config, resolved=resolved, recipe=recipe_name, site=site_name,
                        overrides=tuple(overrides), provenance=provenance)


def load_unresolved(recipe: str, overrides: list[str] | tuple[str, ...] = (), site: str | None = None,
                    *, recipe_site_keys: str = "refuse",
                    unread: tuple[str, ...] = ()) -> tuple[Config, dict[str, str], str, str | None]:
    """load_recipe before resolve(): (config, provenance, recipe name, site profile name). Every section is checked;
    what depends on the world size is not (`embodyhpc resume` explains a batch size the new world cannot divide)."""
    config, provenance, recipe_name, site_name = merge_recipe(recipe, overrides, site,
                                                              recipe_site_keys=recipe_site_keys, unread=unread)
    try:
        validate(config)
    except ConfigError as exc:
        raise located(exc, provenance) from exc
    return config, provenance, recipe_name, site_name


def load_config_file(path: str | Path) -> Config:
    """A resolved config written by submit or by an export (config.yaml next to the weights), validated."""
    return read_config_file(path, check=validate)


def load_resolved(run_dir: str | Path) -> Config:
    """The frozen config a job reads from its run directory (written by submit)."""
    from embodyhpc.rundir import RESOLVED_YAML

    return load_config_file(Path(run_dir) / RESOLVED_YAML)

"""The command lines: ``recipe_main`` runs a recipe (config, run lock, launch), ``tools`` holds
``python -m runtime`` subcommands such as export and inspect."""

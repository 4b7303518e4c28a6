"""Setup: engine options (flags, recipe overlay, refusals of inert options) resolved into an `EngineConfig`, and
`build_engine`, the one way an engine is made.

arg_types.py      argparse value types every subcommand shares, and the flag each `EngineArgs` field gets
args.py           `EngineArgs`: every engine option in one dataclass; generates the CLI flags and the `EngineConfig`
build.py          `build_engine(config)`, the one way an engine is made, and `EXECUTORS`, the executor registry
cli.py            parsers of `kiln generate`, `kiln chat` and `kiln compile` (handlers in commands.py)
inert_options.py  options given that would do nothing in the resolved config, refused with the flag named and why
recipe_config.py  the recipe's overlay on the engine config: where recipe values override flags, each logged
"""

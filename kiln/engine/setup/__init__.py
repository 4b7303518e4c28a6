"""Setup: engine options (flags, recipe overlay, environment, refusals of inert options) resolved into an
`EngineConfig` (resolve.py, one precedence), and `build_engine` / `build_core`, the one way an engine is made.

arg_types.py      argparse value types every subcommand shares, and the flag each `EngineArgs` field gets
args.py           `EngineArgs`: every engine option in one dataclass, which generates the CLI flags
build.py          `build_engine(config)` and `build_core(config, model)`, the one way an engine is made; `EXECUTORS`
cli.py            parsers of `kiln generate`, `kiln chat` and `kiln compile` (handlers in commands.py)
inert_options.py  options given that would do nothing in the resolved config, refused with the flag named and why
recipe_config.py  the recipe's overlay on the engine config: where recipe values override flags, each logged
resolve.py        flags, recipe and environment -> one `EngineConfig` of resolved values, with the one precedence
"""

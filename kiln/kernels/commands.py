"""`kiln kernels build`: the native kernels built at install (kiln.kernels.native.build), so that a first start
loads them instead of compiling (~20 s on a 2-core machine), and inductor's vector-ISA probe recorded beside them
(kiln.kernels.inductor_isa: ~8 s of a first compile). Without a C++ compiler it says so and succeeds:
kiln runs on the torch candidates there. `kiln kernels forget`: this CPU's timed choices dropped from a cache
(kiln.kernels.choices), so the next start times them again."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from kiln.env import read_env
from kiln.errors import ConfigError
from kiln.kernels.choices import KernelChoiceCache
from kiln.kernels.inductor_isa import probe_and_record
from kiln.kernels.native.build import install_tier, runnable_tiers
from kiln.log import setup_logging

logger = logging.getLogger("kiln")


def cmd_build(args: argparse.Namespace) -> int:
    setup_logging()
    failures: list[str] = []
    built = False
    for tier in runnable_tiers():  # widest first
        try:
            path = install_tier(tier)
        except OSError as exc:
            raise ConfigError(
                f"cannot write the native kernels to {exc.filename or exc}: set KILN_NATIVE_DIR to a "
                f"folder this user can write ({exc.strerror or exc})"
            ) from None
        except RuntimeError as exc:
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            if "no C++ compiler" in message:
                logger.info("Native kernels are off: %s; packed products run on the torch candidates", message)
                return 0
            logger.warning("Native kernels (%s tier) did not build: %s", tier.name, message)
            failures.append(tier.name)
            continue
        print(f"{tier.name}: {path}")
        built = True
        if not args.all_tiers:
            break
    if built:  # a compiler that builds here: inductor's ISA probe, recorded so a first start need not run it
        started = time.perf_counter()
        record = probe_and_record()
        logger.info(
            "Probed inductor's vector ISAs in %.1f s: %s passed",
            time.perf_counter() - started,
            ", ".join(record["passed"]) or "none",
        )
    if built and not args.all_tiers:  # the widest tier that builds is what a start loads
        return 0
    return 1 if failures else 0


def cmd_forget(args: argparse.Namespace) -> int:
    cache = KernelChoiceCache(Path(args.choices_dir) if args.choices_dir else read_env().cache_dir)
    dropped = cache.forget_this_machine()
    print(f"forgot {dropped} kernel choice{'s' if dropped != 1 else ''} timed on this CPU in {cache.path}")
    return 0

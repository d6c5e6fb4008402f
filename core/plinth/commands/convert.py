"""``plinth convert``: a Hugging Face model folder to a GGUF file, through a converter plugin."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("convert", help="convert a Hugging Face model folder (config.json + safetensors) to GGUF",
                       description="Convert a Hugging Face model folder to a GGUF file. The converter is the "
                       "plugin registered for config.json's architectures[0] (`plinth plugins` lists them); "
                       "a config it does not understand is refused with the reason.")
    p.add_argument("model_dir", help="folder with config.json and *.safetensors")
    p.add_argument("-o", "--outfile", required=True, help="the GGUF file to write")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a converter option (repeatable; see the plugin's docs)")
    mtp = p.add_mutually_exclusive_group()
    mtp.add_argument("--mtp", dest="mtp", action="store_const", const="yes", default=None,
                     help="export the checkpoint's MTP (next-token-prediction) head; an error when it has none "
                     "(the converter option mtp=yes)")
    mtp.add_argument("--no-mtp", dest="mtp", action="store_const", const="no",
                     help="leave the MTP head out (mtp=no); converters that support it export it when present")
    p.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    from ..convert import convert
    from ..errors import UserError

    options: dict[str, str] = {}
    for item in args.option:
        if "=" not in item:
            raise UserError(f"--option expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        options[k] = v
    if args.mtp is not None:
        if options.get("mtp", args.mtp) != args.mtp:
            raise UserError(f"--{'no-' if args.mtp == 'no' else ''}mtp contradicts --option mtp={options['mtp']}")
        options["mtp"] = args.mtp
    out = convert(args.model_dir, args.outfile, registry=args.registry, options=options)
    print(out)
    return 0

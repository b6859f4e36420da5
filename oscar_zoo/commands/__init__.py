"""One module per command; each exposes `register(app)`. `COMMANDS` names them in the order `oscar-zoo --help` lists
them, with the line it shows for each (the first paragraph of the command's docstring, which tests/test_cli_start.py
holds equal), so that the listing imports no command module (nor torch): a command's module is imported when that
command is resolved, to run or to show its own help (`cli.LazyCommands`)."""

COMMANDS = {  # name: (module, one-line summary)
    "calibrate": ("calibrate", "Calibrate OSCAR rotations and clip ratios for MODEL and write an artifact folder."),
    "verify": ("verify", "Verify ARTIFACTS: how close INT2 attention with these rotations stays to BF16 (exit 3 "
                         "below thresholds)."),
    "inspect": ("inspect", "Show what an artifact folder holds, check every checksum and shape (exit 4 on any "
                           "mismatch)."),
    "push": ("push", "Upload exactly the files the manifest lists, its manifest and a generated model card, and "
                     "update zoo.json."),
    "pull": ("pull", "Download a published artifact folder, pinned to one commit; every sha256 is checked before the "
                     "destination appears."),
    "list": ("list_cmd", "Show every catalogued rotation set: model, granularity, bits per element at 128K, "
                         "verification, location."),
    "export": ("export", "Write the reference implementation's rotation files (`--format oscar-pt`) or its SGLang "
                         "deployment (`--format sglang`)."),
    "import-oscar": ("import_oscar", "Convert the reference implementation's rotation files into an artifact folder "
                                     "(unverified: run `oscar-zoo verify`)."),
}

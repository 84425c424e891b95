"""Every decoding loop, each a Strategy that declares what it can do (base.py): dense decoding,
speculative decoding (chains and trees), and early exits in either (a pass with exits, exit_pass.py).
`builder.build_strategy` makes one from a SpecConfig (config.py: every decoding option, declared once)."""

"""Search-space files (TOML) shipped with pallas-tune; read them with ``pallas_tune.load_space``."""

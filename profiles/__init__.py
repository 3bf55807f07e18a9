"""The device profiles shipped with jetsplit, as package data (`jetsplit.bundled_profiles`):
the TOML files beside this one are found the same way in a checkout, an editable install
and a wheel (jetsplit.profiles.bundled_profiles_dir)."""

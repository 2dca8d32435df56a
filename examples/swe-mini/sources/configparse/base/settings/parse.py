"""Reading `key=value` settings."""


def parse_settings(text: str) -> dict:
    settings = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=")
        settings[key.strip()] = value.strip()
    return settings

from ..relay.process import RELAY_URL_ENV, RelayProcess  # noqa: F401  moved; core's import is updated by the lead

"""The server's HTTP routes, one static `APIRouter` per module: `health`, `infer`, `sync` (weight sync)
and `metrics`; `app.create_app` includes them, all but `health` behind the bearer token."""

__all__: list[str] = []

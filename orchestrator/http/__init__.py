"""The service over HTTP: the API (`api`: the app, its routers by resource), its client (`client`), the child
process that holds the Ray connection (`bridge`), tokens and users, job submissions over HTTP, the web console."""

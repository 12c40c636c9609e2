"""What every HTTP front end shares (the server and the proxy): the draining uvicorn server
and the registration messages between instances and proxies."""

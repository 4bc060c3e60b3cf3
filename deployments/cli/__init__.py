"""The `lmserve` command: serve, api, chat, batch, check, download (`main.main` is the entry point)."""

"""The `ftc` command line: the top layer, above the library (`ftc`), the service, the API and the
workers. Each sub-command is a small module that parses its flags and calls the layers below;
nothing below imports this package."""

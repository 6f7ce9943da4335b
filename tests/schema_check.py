"""A JSON Schema checker for the tests: the subset ``tf_rdma/doctor_schema.json`` uses.

The doctor tests check ``tf-rdma doctor --json`` against the schema with
:func:`validate`; the library itself never validates its report (it builds
it), so the checker lives here, without a ``jsonschema`` dependency.
"""

import re

__all__ = ["validate"]


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _type_ok(value, name):
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def validate(instance, schema, path="$"):
    """Checks a JSON value against the subset of JSON Schema the doctor's schema uses.

    Supported keywords: ``type`` (a name or a list), ``properties``,
    ``required``, ``additionalProperties`` (false or a schema), ``items``,
    ``enum``, ``const``, ``minimum``, ``$ref`` to ``#/definitions/NAME``.

    Args:
        instance: The value to check.
        schema: The schema (the root schema on the first call).
        path: Where ``instance`` is, for messages.

    Returns:
        A list of error messages, each naming the path and the bad value;
        empty when the value is valid.
    """
    return _validate(instance, schema, path, schema)


def _validate(value, schema, path, root):
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/definitions/"):
            return [f"{path}: unsupported $ref {ref!r}"]
        return _validate(value, root["definitions"][ref.split("/")[-1]], path, root)
    errors = []
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_type_ok(value, n) for n in names):
            return [f"{path}: {value!r} is not of type {' or '.join(names)}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']!r}")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: {value!r} is not {schema['const']!r}")
    if "minimum" in schema and isinstance(value, (int, float)) and not isinstance(value, bool) \
            and value < schema["minimum"]:
        errors.append(f"{path}: {value!r} is below the minimum {schema['minimum']!r}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: required property {key!r} is missing")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                errors += _validate(item, props[key], f"{path}.{key}", root)
            elif extra is False:
                errors.append(f"{path}: property {key!r} is not allowed")
            elif isinstance(extra, dict):
                errors += _validate(item, extra, f"{path}.{key}", root)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += _validate(item, schema["items"], f"{path}[{i}]", root)
    return errors

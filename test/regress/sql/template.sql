-- Templates: {{ path }} against a context.
SELECT tuvl.render('"{{ n }}"', '{"n": 42}') AS sole_placeholder_keeps_number;
SELECT tuvl.render('"{{ o }}"', '{"o": {"a": [1, 2]}}') AS sole_placeholder_keeps_object;
SELECT tuvl.render('"n = {{ n }}, o = {{ o }}, s = {{ s }}, z = {{ z }}"',
                   '{"n": 1.5, "o": {"a": 1}, "s": "text", "z": null}') AS interpolated;
SELECT tuvl.render('{"order": "{{ order.0.id }}", "list": ["{{ order.0.status }}", 7]}',
                   '{"order": [{"id": 3, "status": "paid"}]}') AS nested;
SELECT tuvl.render('"  {{   a.b  }} "', '{"a": {"b": true}}') AS whitespace_allowed;
SELECT tuvl.render('{"keys_are_not_rendered {{ x }}": 1}', '{}') AS keys_untouched;
-- Errors
SELECT tuvl.render('"{{ a.missing }}"', '{"a": {}}');
SELECT tuvl.render('"{{ a.0 }}"', '{"a": []}');
SELECT tuvl.render('"{{ unclosed"', '{}');
SELECT tuvl.render('"{{ bad path! }}"', '{}');
SELECT tuvl.render('"{{ secrets.api }}"', '{}');

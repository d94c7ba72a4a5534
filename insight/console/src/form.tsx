/*
 * form.tsx: a Human step's form, rendered from its JSON Schema by
 * react-jsonschema-form and validated by Ajv before it is sent.  A chunk of
 * its own (main.tsx loads it with lazy()), so that the pages without a form
 * do not parse the form library (more than half of the script).
 */
import type { ReactNode } from "react";
import Form from "@rjsf/core";
import validator from "@rjsf/validator-ajv8";

export default function SchemaForm({ schema, onSubmit, children }: {
    schema: any; onSubmit: (data: unknown) => void | Promise<void>; children: ReactNode;
}): ReactNode {
    return <Form schema={schema} validator={validator} noHtml5Validate showErrorList="top"
        onSubmit={({ formData }) => onSubmit(formData)}>{children}</Form>;
}

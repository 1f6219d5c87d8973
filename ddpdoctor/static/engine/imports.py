"""Imports of the interpreter: a module of the user's project is interpreted like the script itself.

Without a `Project` (one source text, no file around it) every import binds an opaque qualified name (`qual`), which
the models resolve to library APIs. With one, an import that resolves to a project file (`project.Project.resolve`)
binds a *module object* (`pymodule`) or, for `from m import name`, a *lazy binding* (`lazy`): the module's body runs
the first time one of its names is used — once, in its own global scope, outside any branch of the importer — and
the name then holds what the module defined (a function, a class, a re-exported torch API, a submodule). A call into
a helper is then entered at its call site like any function of the script, so what it does to models, data and
process groups is recorded with the helper's file and line and the call chain that led there.

Modules load lazily because packages re-export everything from their `__init__` (timm's loads hundreds of files);
an import used only for its side effects is therefore not interpreted. `from m import *` is resolved name by name
when a lookup misses. A name a module does not define (or a module that is not read: a syntax error, past the
budget) falls back to the opaque qualified name an unresolved import would have given.
"""

from __future__ import annotations

import ast

from ddpdoctor.static.project import ModuleFile
from ddpdoctor.static.semantic import Frame, Obj, Value, union


class ImportsMixin:
    """The import half of `Interpreter`."""

    # ------------------------------------------------------------------ statements

    def st_Import(self, st: ast.Import) -> None:
        for alias in st.names:
            found = self.imported(self.project.resolve(alias.name, 0, self.current_module())) if self.project else None
            if found is None:
                if alias.asname:
                    self.bind_name(alias.asname, (self.new("qual", st, qual=alias.name, label=alias.asname),))
                else:
                    top = alias.name.split(".")[0]
                    self.bind_name(top, (self.new("qual", st, qual=top, label=top),))
            elif alias.asname:
                self.bind_name(alias.asname, (self.pymodule(found, st),))
            else:
                top = alias.name.split(".")[0]
                top_module = self.imported(self.project.resolve(top, 0, self.current_module())) or found
                self.bind_name(top, (self.pymodule(top_module, st),))

    def st_ImportFrom(self, st: ast.ImportFrom) -> None:
        level = st.level or 0
        found = (
            self.imported(self.project.resolve(st.module or "", level, self.current_module())) if self.project else None
        )
        module = "." * level + (st.module or "")
        for alias in st.names:
            name = alias.asname or alias.name
            if alias.name == "*":
                if found is not None:
                    self.frame.stars.append(found)
                continue
            if found is None:
                q = f"{module}.{alias.name}" if module and not module.endswith(".") else f"{module}{alias.name}"
                self.bind_name(name, (self.new("qual", st, qual=q, label=name),))
            else:
                lazy = self.new("lazy", st, label=name, props={"module": found, "name": alias.name})
                self.bind_name(name, (lazy,))
                self.frame.lazy.add(name)

    # ------------------------------------------------------------------ modules

    def current_module(self) -> ModuleFile | None:
        return self._module_of_file.get(self.frame.file)

    def imported(self, module: ModuleFile | None) -> ModuleFile | None:
        """A module the current one imports, at one more import level than it (the script is level 0)."""
        if module is None:
            return None
        current = self.current_module()
        depth = self._module_depth.get(current.path, 0) + 1 if current is not None else 1
        if depth < self._module_depth.get(module.path, depth + 1):
            self._module_depth[module.path] = depth
        return module

    def pymodule(self, module: ModuleFile, node: ast.AST | None) -> Obj:
        obj = self._pymodules.get(module.path)
        if obj is None:
            obj = self.new("pymodule", node, label=module.name.rsplit(".", 1)[-1], props={"module": module})
            self._pymodules[module.path] = obj
        return obj

    def execute_module(self, module: ModuleFile) -> Frame | None:
        """The global scope of a project module, its body interpreted the first time it is asked for (a module
        being interpreted — an import cycle — is returned as far as it got)."""
        path = module.path
        if path in self._module_frames:
            return self._module_frames[path]
        if self.project is None or module.namespace:
            self._module_frames[path] = None
            return None
        source = self.project.load(module, depth=self._module_depth.get(path, 1))
        if source is None:
            self._module_frames[path] = None
            return None
        self.add_source(source, module)
        frame = Frame(
            id=next(self._frame_ids), name="<module>", locals={}, lexical=None, node=source.tree, file=source.path
        )
        frame.locals["__name__"] = (self.const(module.name, None),)
        frame.locals["__file__"] = (self.const(str(path), None),)
        self._module_frames[path] = frame
        self._file_frames[source.path] = frame
        saved = (self.ctx, self.frames, self._guard, self.save_state())
        self.ctx, self.frames, self._guard = [], [frame], None
        self._import_depth += 1
        try:
            self.block(source.tree.body)
        finally:
            self._import_depth -= 1
            self.ctx, self.frames, self._guard = saved[0], saved[1], saved[2]
            self.restore_state(saved[3])
        return frame

    def module_attr(self, module: ModuleFile, name: str, node: ast.AST | None) -> Value:
        """`module.name`: what the module defines, else its submodule, else the opaque qualified name."""
        if module.path not in self._module_depth:
            self.imported(module)
        key = (module.path, name)
        if key in self._resolving:
            return (self.new("qual", node, qual=f"{module.name}.{name}", label=name),)
        self._resolving.add(key)
        try:
            frame = self.execute_module(module)
            if frame is not None:
                if name in frame.locals:
                    return self.resolve_lazy(frame, name)
                starred = self.from_stars(frame, name, node)
                if starred is not None:
                    return starred
            sub = self.project.submodule(module, name) if self.project else None
            if sub is not None:
                depth = self._module_depth.get(module.path, 1)
                self._module_depth[sub.path] = min(self._module_depth.get(sub.path, depth), depth)
                return (self.pymodule(sub, node),)
            return (self.new("qual", node, qual=f"{module.name}.{name}", label=name),)
        finally:
            self._resolving.discard(key)

    def resolve_lazy(self, frame: Frame, name: str) -> Value:
        """The value of `name` in `frame`, with lazy import bindings replaced by what they name (once)."""
        value = frame.locals[name]
        if name not in frame.lazy:
            return value
        frame.lazy.discard(name)
        if not any(o.kind == "lazy" for o in value):
            return value
        out: list[Obj] = []
        for o in value:
            if o.kind == "lazy":
                out.extend(self.module_attr(o.props["module"], o.props["name"], o.node))
            else:
                out.append(o)
        resolved = union(out)
        frame.locals[name] = resolved
        if frame.written is not None:
            frame.written.add(name)
        return resolved

    def from_stars(self, frame: Frame, name: str, node: ast.AST | None) -> Value | None:
        """`name` from the `from m import *` of a module's global scope, latest first."""
        for module in reversed(frame.stars):
            source = self.project.load(module, depth=self._module_depth.get(module.path, 1)) if self.project else None
            if source is None:
                continue
            names, exported = source.top_names
            if name not in names or (name not in exported if exported is not None else name.startswith("_")):
                continue
            return self.module_attr(module, name, node)
        return None

// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors
//
// The one helper the kernel library and the plugins share for their error messages.

#ifndef ENGRAM_TRT_SOURCE_FILE_NAME_H
#define ENGRAM_TRT_SOURCE_FILE_NAME_H

namespace engram_trt
{

//! The file name of a __FILE__ path, at compile time (failure messages name the file and
//! line, not the build machine's directories).
constexpr char const* sourceFileName(char const* path)
{
    char const* name = path;
    for (char const* p = path; *p != '\0'; ++p)
    {
        if (*p == '/' || *p == '\\')
        {
            name = p + 1;
        }
    }
    return name;
}

} // namespace engram_trt

#endif // ENGRAM_TRT_SOURCE_FILE_NAME_H
